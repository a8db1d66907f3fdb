"""Hierarchical (two-level) strategies: usp, double_ring, token_ring_2d over grids of nodes x ranks per node.

Against the float64 reference, forward and backward (tolerances as everywhere: float64 1e-9, float32 1e-5,
bfloat16 2e-2): P = 4 as 2x2, P = 6 as 2x3 and 3x2 (and nodes of one rank / one node of all ranks), causal
and not, zigzag and contiguous, MHA / GQA / MQA, odd head dims, batch 1-2, packed documents and windows; the
node size from ``inner_size=`` and from ``$LOCAL_WORLD_SIZE``; ``auto`` choosing among them. Schedules:
every attended pair computed exactly once (tests/test_units.py covers them too), and what crosses nodes.
"""

import itertools
import random
from types import SimpleNamespace

import cases
import pytest
import torch

from tokenring.schedules import Shapes, message_bytes
from tokenring.strategies import get, why_not, with_node_size

HEADS = [(4, 4), (4, 2), (6, 1)]
LAYOUTS = [(False, "contiguous"), (True, "contiguous"), (True, "zigzag"), (False, "zigzag")]


def specs(n: int) -> list[str]:
    """Every hierarchical strategy, with the inner variants that exist for nodes of ``n`` ranks."""
    out = [f"usp:n={n}", f"double_ring:n={n}", f"token_ring_2d:relay,n={n}"]
    for c, k in ((1, 1), (2, max(1, n - 1))):
        out += [f"token_ring_2d:direct,c={c},k={k},n={n}", f"double_ring:direct,c={c},k={k},n={n}"]
    return out + [f"token_ring_2d:relay,n={n},o=2"]  # visiting rounds in two sub-rounds


def keep_specs(n: int) -> list[str]:
    """Two-level strategies that keep forward's inter-node K/V for backward (a ring and a direct inner)."""
    return [
        f"double_ring:n={n},keep",
        f"token_ring_2d:relay,n={n},keep",
        f"token_ring_2d:direct,c=2,k={max(1, n - 1)},n={n},keep",
        f"double_ring:direct,c=1,k=1,n={n},keep",
        f"double_ring:direct,c=2,k=1,n={n},keep,o=2",
    ]  # outer chunks, each cut again by the inner pass-KV


def grid(P: int, n: int, dtypes=("float64",), names=specs) -> list[dict]:
    out = []
    for i, (spec, (causal, layout), (H, Hkv), dtype) in enumerate(itertools.product(names(n), LAYOUTS, HEADS, dtypes)):
        s = 10 + 2 * (i % 3)  # even (zigzag), at least the pieces a direct inner schedule cuts
        if why_not(spec, H, Hkv, P, s, causal and layout == "zigzag"):
            continue
        out.append(
            dict(
                B=1 + i % 2,
                s=s,
                H=H,
                Hkv=Hkv,
                d=(8, 13, 16)[i % 3],
                dtype=dtype,
                causal=causal,
                layout=layout,
                strategy=spec,
                seed=i,
            )
        )
    return out


@pytest.mark.parametrize("P,n", [(4, 2), (6, 2), (6, 3)])
def test_match_reference(pools, P, n):
    todo = grid(P, n)
    assert len(todo) > 40
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


@pytest.mark.parametrize("P,n", [(4, 2), (6, 2), (6, 3)])
def test_keep_matches_reference(pools, P, n):
    """``keep``: backward reuses the K/V that crossed nodes in forward (kept pieces travel with autograd's saved
    tensors); exact forward and backward on every grid, ring and direct inner schedules."""
    todo = [c for c in grid(P, n, names=keep_specs) if c["seed"] % 2 == 0]
    assert len(todo) > 12
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


def test_keep_specs():
    assert get("double_ring:keep").name == "double_ring:keep" and get("double_ring:keep").keep
    assert get("double_ring:n=2,keep").name == "double_ring:n=2,keep"
    assert get("token_ring_2d:direct,c=2,k=1,n=4,keep").keep
    assert all(v.keep for v in get("token_ring_2d:n=4,keep").variants(8))
    from tokenring.strategies import code, from_code

    for spec in ("double_ring:n=2,keep", "token_ring_2d:direct,c=2,k=1,n=4,keep", "usp:n=2", "ring"):
        assert from_code(code(get(spec))) is get(spec)
    assert with_node_size(get("double_ring:keep"), 4).name == "double_ring:n=4,keep"
    for bad in ("ring:keep", "usp:n=2,keep", "ulysses:keep", "token_ring:direct,c=1,k=1,keep"):
        with pytest.raises(ValueError):
            get(bad)


@pytest.mark.parametrize("P,n", [(4, 1), (4, 4)])
def test_degenerate_grids(pools, P, n):
    """Nodes of one rank (everything between nodes) and one node of every rank (a flat schedule)."""
    todo = [c for c in grid(P, n) if c["seed"] % 3 == 0]
    todo += [c for c in grid(P, n, names=keep_specs) if c["seed"] % 5 == 0]  # keep: the own round last
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


def test_rounds_that_end_empty(pools):
    """Masks that leave a two-level schedule's last rounds empty: what is due in them is due at the end (once
    such dues overran the schedule, and only the ranks holding them failed: the others waited)."""
    todo = [
        dict(
            B=3,
            s=1,
            H=1,
            Hkv=1,
            d=32,
            dtype="float64",
            causal=True,
            layout="contiguous",
            strategy="token_ring_2d:relay,n=3",
            scale=1.1435,
            seed=5378,
            window=(1, 0),
        ),
        dict(
            B=2,
            s=7,
            H=4,
            Hkv=1,
            d=38,
            dtype="float64",
            causal=True,
            layout="contiguous",
            strategy="double_ring:n=2",
            scale=1.8092,
            seed=12579,
            window=(1, 37),
        ),
        dict(
            B=1,
            s=10,
            H=12,
            Hkv=3,
            d=2,
            dtype="float64",
            causal=False,
            layout="zigzag",
            strategy="token_ring_2d:direct,c=1,k=2,n=3",
            scale=0.9717,
            seed=38054,
            cu_seqlens=[0, 1, 31, 34, 38, 47, 53, 59, 60],
            window=(0, 1),
        ),
    ]
    assert pools(6).run(cases.check_many, todo) == [len(todo)] * 6


@pytest.mark.parametrize("seed", range(4))
def test_random_masked_schedules_stay_within_their_steps(seed):
    """Every message of a two-level schedule (any node size, keep, outer chunks, random documents and windows)
    is due within the schedule: ``Schedule`` refuses one that is not, on every rank alike."""
    from tokenring.masks import make_mask

    rng = random.Random(seed)
    built = 0
    for _ in range(150):
        P = rng.choice([2, 3, 4, 6, 8])
        n = rng.choice([d for d in range(1, P + 1) if P % d == 0])
        s, causal, layout = rng.randint(1, 12), rng.random() < 0.5, rng.choice(["contiguous", "zigzag"])
        s += layout == "zigzag" and s % 2
        c, k = rng.randint(1, 3), rng.randint(1, max(1, n - 1))
        spec = rng.choice(
            [
                f"token_ring_2d:relay,n={n}",
                f"double_ring:n={n}",
                f"token_ring_2d:direct,c={c},k={k},n={n}",
                f"double_ring:direct,c={c},k={k},n={n}",
            ]
        )
        spec += ",keep" * (rng.random() < 0.4) + f",o={rng.randint(2, 3)}" * (rng.random() < 0.4)
        S = s * P
        cu = [0] + sorted(rng.sample(range(1, S), min(S - 1, rng.randint(1, 6)))) + [S] if S > 1 else None
        window = (rng.choice([-1, 0, 1, 2, s]), rng.choice([-1, 0, 1, s])) if rng.random() < 0.5 else None
        if why_not(spec, 24, 2, P, s, causal and layout == "zigzag"):
            continue
        try:
            mask = make_mask(S, cu, window, causal)
        except ValueError:  # e.g. a window that is not allowed with this mask
            continue
        for backward in (False, True):
            sched = get(spec).schedule(P, layout, causal, backward, mask)
            assert all(m.due < len(sched.steps) for st in sched.steps for m in st.messages)
            built += 1
    assert built > 100


def test_low_precision(pools):
    todo = [c for c in grid(4, 2, ("float32", "bfloat16")) if c["seed"] % 4 == 0]
    assert pools(4).run(cases.check_many, todo) == [len(todo)] * 4


def test_documents_and_windows(pools):
    """Packed documents, sliding windows (blocks nobody sees are skipped: the rounds are cut for the mask) and
    zigzag_docs, on every hierarchical strategy (and with keep: the kept pieces follow the masked schedule)."""
    P, n, rng, todo = 4, 2, random.Random(4), []
    for i, spec in enumerate(specs(n) + keep_specs(n)[::2]):
        for causal, window, layout in (
            (True, None, "zigzag"),
            (False, (5, 3), "contiguous"),
            (True, (9, 0), "zigzag"),
            (True, None, "zigzag_docs"),
        ):
            s = 12
            S = s * P
            if layout == "zigzag_docs":
                cu = [0, 16, 24, S]  # every document a multiple of 2P
            else:
                cu = [0] + sorted(rng.sample(range(1, S), 3)) + [S]
            H, Hkv = HEADS[i % 3]
            if why_not(spec, H, Hkv, P, s, causal and layout == "zigzag"):
                continue
            todo.append(
                dict(
                    B=1,
                    s=s,
                    H=H,
                    Hkv=Hkv,
                    d=8,
                    dtype="float64",
                    causal=causal,
                    layout=layout,
                    strategy=spec,
                    cu_seqlens=cu,
                    window=window,
                    seed=i,
                )
            )
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


def test_node_size_from_argument_environment_and_auto(pools):
    """``strategy="double_ring"`` with ``inner_size=``, with ``$LOCAL_WORLD_SIZE`` (as torchrun sets it), the
    family choice ``token_ring_2d`` (cost model picks the inner variant), and ``auto`` on a two-level topology
    (it may pick a hierarchical strategy): all exact."""
    base = dict(B=1, s=8, H=4, Hkv=2, d=8, dtype="float64", causal=True, layout="zigzag", seed=3)
    todo = [
        dict(base, strategy="double_ring", inner_size=2),
        dict(base, strategy="usp", env={"LOCAL_WORLD_SIZE": "2"}),
        dict(base, strategy="token_ring_2d", inner_size=2),
        dict(base, strategy="auto", inner_size=2, topology="ib-2x8"),
    ]
    assert pools(4).run(cases.check_many, todo) == [len(todo)] * 4


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("inner_missing", "inner_size"),
        ("inner_indivisible", "divide"),
        ("usp_heads", "H % n"),
        ("inner_differ", "different"),
    ],
)
def test_bad_node_sizes_raise_on_every_rank(pools, kind, needle):
    for msg in pools(4).run(cases.expect_error, kind):
        assert needle in msg, msg


def _attended(S, P, layout, causal):
    from tokenring.layouts import local_positions

    pos = [local_positions(S, P, r, layout).tolist() for r in range(P)]
    return pos, {
        (a, b) for j, r in itertools.product(range(P), range(P)) for a in pos[j] for b in pos[r] if not causal or b <= a
    }


@pytest.mark.parametrize("P,n", [(4, 2), (6, 2), (6, 3), (8, 4), (8, 2)])
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")])
def test_two_level_schedules_cover_each_pair_once(P, n, causal, layout):
    """Every attended pair computed exactly once, no masked pair computed, every compute's inputs held by the
    rank that runs it (a message counts from the step after it is due)."""
    from tokenring.schedules import covers, part_slice

    s = 12
    pos, need = _attended(s * P, P, layout, causal)
    for spec in specs(n)[1:] + keep_specs(n):  # usp's ring runs over node rows: covered by the correctness tests
        if why_not(spec, 4, 4, P, s, causal and layout == "zigzag"):
            continue
        st = get(spec)
        for sched in (st.forward_schedule(P, layout, causal), st.backward_schedule(P, layout, causal)):
            seen = []
            have = {(r, kind, r): [("all", -1)] for r in range(P) for kind in ("q", "qgrad", "kv")}
            if sched.backward:  # what keep brought from forward (nothing without keep)
                for r in range(P):
                    cfg = SimpleNamespace(rank=r, P=P, layout=layout, causal=causal, mask=None)
                    for owner, part in st.kept_pieces(cfg):
                        have.setdefault((r, "kv", owner), []).append((part, -1))
            for t, step in enumerate(sched.steps):
                for c in step.computes:
                    for kind, owner, part in ((sched.q_kind, c.q_owner, c.q_part), ("kv", c.kv_owner, c.kv_part)):
                        assert any(ready < t and covers(p, part) for p, ready in have.get((c.rank, kind, owner), [])), (
                            spec,
                            sched.backward,
                            t,
                            c,
                        )
                    seen += [
                        (a, b)
                        for a in pos[c.q_owner][part_slice(c.q_part, s)]
                        for b in pos[c.kv_owner][part_slice(c.kv_part, s)]
                        if not c.diag or b <= a
                    ]
                for m in step.messages:
                    assert m.src != m.dst and (m.due == -1 or t <= m.due < len(sched.steps)), (spec, t, m)
                    have.setdefault((m.dst, m.kind, m.owner), []).append((m.part, max(t, m.due)))
            assert len(seen) == len(set(seen)), f"{spec}: a pair computed twice"
            assert set(seen) == need, spec


@pytest.mark.parametrize(
    "spec",
    [
        "double_ring",
        "token_ring_2d:relay",
        "token_ring_2d:direct,c=2,k=1",
        "usp",
        "double_ring:keep",
        "token_ring_2d:direct,c=2,k=1,keep",
        "double_ring:o=2",
        "token_ring_2d:direct,c=2,k=1,keep,o=4",
    ],
)
def test_inter_node_bytes(spec):
    """Non-causal, P = 8 as 2 nodes x 4: what each rank sends to another node, against the hand count.
    Forward: one K/V block per round after the first for the K/V-ring strategies (m - 1 = 1 block), and for
    usp the K/V of its head group over the node's rows (the same bytes); flat ring: the ranks at a node's
    edge send all P - 1 blocks across. Backward adds the dK/dV (float32 accumulators) going home; with
    ``keep`` backward sends only those (forward's K/V are reused)."""
    P, n, m = 8, 4, 2
    sh = Shapes(1, 64, 8, 4, 16, torch.bfloat16, P)
    kv_block = 2 * sh.B * sh.s * sh.Hkv * sh.d * 2
    st = with_node_size(get(spec), n)
    for backward in (False, True):
        sched = st.schedule(P, "contiguous", False, backward)
        across = [0] * P
        for step in sched.steps:
            for msg in step.messages:
                if msg.src // n != msg.dst // n:
                    across[msg.src] += message_bytes(msg, sh, st.payload)
        kv_again = 0 if st.keep else 1
        want = (m - 1) * kv_block * (1 if not backward else kv_again + 2)  # dK/dV in float32: 2x the bf16 K/V
        assert across == [want] * P, (spec, backward, across, want)
    flat = get("ring").schedule(P, "contiguous", False, False)
    edge = sum(message_bytes(x, sh) for st_ in flat.steps for x in st_.messages if x.src == n - 1)
    assert edge == (P - 1) * kv_block


@pytest.mark.parametrize("m,n,o", [(2, 2, 2), (3, 2, 2), (2, 3, 4), (4, 2, 2)])
def test_outer_chunks_and_keep_order(m, n, o):
    """``o=``: a visiting round runs as ``o`` sub-rounds over row chunks of the K/V block that crossed nodes, and
    each chunk crosses in its own message, due just before its sub-round (so compute starts on the first rows
    while the rest is on the wire). With ``keep`` backward runs the visiting rounds first and its own round last,
    every dK/dV leaving for another node while that round still computes."""
    from tokenring.schedules import chunk

    P = m * n
    st = get(f"double_ring:n={n},keep,o={o}")
    fwd = st.forward_schedule(P, "contiguous", False)
    crossing = [(t, x) for t, step in enumerate(fwd.steps) for x in step.messages if x.src // n != x.dst // n]
    assert sorted(x.part for _, x in crossing if x.dst == 0) == sorted([chunk("all", i, o) for i in range(o)] * (m - 1))
    first_use = {}
    for t, step in enumerate(fwd.steps):
        for c in step.computes:
            first_use.setdefault((c.rank, c.kv_owner, c.kv_part), t)
    for t, x in crossing:  # each chunk is due right before the first compute on it, and the first one is used
        assert x.due == first_use[x.dst, x.owner, x.part] - 1  # before the whole block could have arrived
    assert min(first_use[x.dst, x.owner, x.part] for _, x in crossing if x.part == chunk("all", 0, o)) < max(
        first_use[x.dst, x.owner, x.part] for _, x in crossing
    )
    bwd = st.backward_schedule(P, "contiguous", True)
    own_start = min(t for t, step in enumerate(bwd.steps) for c in step.computes if c.kv_owner // n == c.rank // n)
    last_visit = max(t for t, step in enumerate(bwd.steps) for c in step.computes if c.kv_owner // n != c.rank // n)
    assert last_visit < own_start
    own_end = max(t for t, step in enumerate(bwd.steps) for c in step.computes)
    home = [
        t for t, step in enumerate(bwd.steps) for x in step.messages if x.kind == "dkv" and x.src // n != x.dst // n
    ]
    assert (
        home
        and max(home) <= own_end
        and not any(x.kind == "kv" for step in bwd.steps for x in step.messages if x.src // n != x.dst // n)
    )


def test_outer_chunks_of_masked_blocks_do_not_overlap():
    """With a mask the pairs of one K/V block meet different rows of it; the sub-rounds cut one grid per block
    (the rows the round needs), so no row crosses twice and no dK/dV row is sent home from two sub-rounds."""
    from tokenring.masks import make_mask
    from tokenring.schedules import overlaps, part_intersection

    assert part_intersection("lo", "1:3/4") == "1:2/4" and part_intersection("lo", "hi") is None
    P, n = 4, 2
    mask = make_mask(12 * P, [0, 4, 7, 46, 48], (9, 0), True)
    for backward in (False, True):
        sched = get(f"double_ring:n={n},o=2").schedule(P, "zigzag", True, backward, mask)
        kinds = ("dkv",) if backward else ("kv",)
        pieces: dict = {}
        for step in sched.steps:
            for x in step.messages:
                if x.kind in kinds and x.src // n != x.dst // n:
                    pieces.setdefault((x.src, x.dst, x.owner), []).append(x.part)
        assert pieces
        for parts in pieces.values():
            assert not any(overlaps(a, b) for i, a in enumerate(parts) for b in parts[i + 1 :]), parts


def test_outer_chunks_refused_when_rows_run_out():
    assert "o=" in why_not("double_ring:n=2,o=4", 4, 4, 4, s=6, zigzag=True)  # halves of 3 rows in 4 pieces
    assert why_not("double_ring:n=2,o=2", 4, 4, 4, s=6, zigzag=True) is None
    assert why_not("double_ring:direct,c=2,k=1,n=2,o=2", 4, 4, 4, s=6) is None  # 6 rows in 2 x 2 pieces
    assert "o=" in why_not("double_ring:direct,c=2,k=1,n=2,o=2", 4, 4, 4, s=6, zigzag=True)  # 3 rows in 4
    for bad in ("ring:o=2", "usp:n=2,o=2", "double_ring:o=0"):
        with pytest.raises(ValueError):
            get(bad)
