"""Packed sequences (``cu_seqlens``) and sliding windows (``window``): every strategy against the float64
reference with the same mask written independently (``cases.allowed``); the tiles that cut a block; the
bytes the schedules skip; bad arguments.

Tolerances as everywhere: float64 1e-9, float32 1e-5, bfloat16 2e-2 (relative to the reference's max).
"""

import random

import cases
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenring.masks import make_mask, tiles, visible
from tokenring.strategies import why_not

STRATEGIES = [
    "token_ring:relay",
    "token_ring:direct,c=2,k=1",
    "ring",
    "ring:direct,c=2,k=1",
    "ring_bidir",
    "ulysses",
    "auto",
]


def documents(S: int, s: int, rng: random.Random) -> list[int]:
    """cu_seqlens with a document shorter than one shard, one longer than two shards when S allows, the rest
    random (some of one token)."""
    cuts = {1, rng.randrange(2, s)}  # a one-token document and one shorter than a shard
    if S > 3 * s:
        start = rng.randrange(s, S - 2 * s)
        cuts |= {start, start + 2 * s + 1}  # a document over more than two shards
    cuts |= set(rng.sample(range(1, S), min(3, S - 1)))
    return [0] + sorted(c for c in cuts if 0 < c < S) + [S]


def grid(P: int) -> list[dict]:
    rng = random.Random(1000 + P)
    out = []
    i = 0
    for strategy in STRATEGIES:
        for causal in (False, True):
            for mode in ("docs", "docs spanning all", "window<shard", "window=shard", "window>shard", "docs+window"):
                i += 1
                H, Hkv = (4, 2) if i % 2 else (4, 4)
                if strategy != "auto" and why_not(strategy, H, Hkv, P):
                    H, Hkv = 2 * P, 2  # Ulysses: heads divisible by P
                s = 2 * (3 + i % 4)  # 6..12 rows per rank
                S = s * P
                case = dict(
                    B=1 + i % 2,
                    s=s,
                    H=H,
                    Hkv=Hkv,
                    d=(8, 12, 16)[i % 3],
                    causal=causal,
                    layout="zigzag" if causal and i % 3 else "contiguous",
                    strategy=strategy,
                    seed=i,
                    dtype=("float64", "float64", "float32", "bfloat16")[i % 4],
                )
                if mode == "docs spanning all":  # short documents at both ends, one over every rank between
                    case["cu_seqlens"] = [0, 1, 2 + i % (s - 2), S - 1, S]
                elif "docs" in mode:
                    case["cu_seqlens"] = documents(S, s, rng)
                if "window" in mode:
                    w = {"window<shard": s // 2, "window=shard": s, "window>shard": s + 3, "docs+window": 3}[mode]
                    case["window"] = (w, rng.choice([-1, 0, 2, w]))
                out.append(case)
    return out


def per_document_cases(P: int) -> list[dict]:
    """layout="zigzag_docs": random documents of multiples of 2P tokens (one of 2P, one long), every strategy."""
    rng = random.Random(77 + P)
    out = []
    for i, strategy in enumerate(STRATEGIES):
        lengths = [2 * P, 2 * P * 5] + [2 * P * rng.randint(1, 3) for _ in range(2)]
        rng.shuffle(lengths)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        H, Hkv = (2 * P, 2) if strategy == "ulysses" else (4, 2 if i % 2 else 4)
        for causal in (True, False):
            case = dict(
                B=1 + i % 2,
                s=cu[-1] // P,
                H=H,
                Hkv=Hkv,
                d=8,
                dtype="float64",
                causal=causal,
                layout="zigzag_docs",
                strategy=strategy,
                seed=i,
                cu_seqlens=cu,
            )
            if i % 3 == 0:
                case["window"] = (5, 1)
            out.append(case)
    return out


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_packed_and_windowed_match_reference(pools, P):
    todo = grid(P) + per_document_cases(P)
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


def test_per_document_zigzag_balances_causal_work():
    """Forward query-key pairs per rank (from the tiles of ring's schedule), 16 random documents at P=4: the
    per-document layout within 2% of perfect balance, zigzag over the packed sequence far from it."""
    from tokenring.masks import shard_rows, shard_tiles
    from tokenring.schedules import part_slice
    from tokenring.strategies import get

    P, rng = 4, random.Random(9)
    lengths = [2 * P * rng.randint(1, 64) for _ in range(16)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    S = cu[-1]
    work = {}
    for layout in ("zigzag", "zigzag_docs"):
        mask = make_mask(S, cu, None, True, force=True)
        per_rank = [0] * P
        for step in get("ring").schedule(P, layout, True, False, mask).steps:
            for c in step.computes:
                qs, ks = part_slice(c.q_part, S // P), part_slice(c.kv_part, S // P)
                qpos, kpos = shard_rows(mask, P, layout, c.q_owner, qs), shard_rows(mask, P, layout, c.kv_owner, ks)
                for t in shard_tiles(mask, P, layout, c.q_owner, (qs.start, qs.stop), c.kv_owner, (ks.start, ks.stop)):
                    n = t.q1 - t.q0
                    per_rank[c.rank] += (
                        n * (n + 1) // 2
                        if t.kind == "causal"
                        else n * (t.k1 - t.k0)
                        if t.kind == "full"
                        else int(t.mask(mask, qpos, kpos).sum())
                    )
        work[layout] = max(per_rank) / (sum(per_rank) / P)
    assert work["zigzag_docs"] < 1.02, work
    assert work["zigzag"] > 1.1, work


def test_per_document_layout_shards_and_refuses():
    from tokenring.layouts import gather, local_positions, shard

    cu = [0, 8, 24, 32]
    pos = torch.cat([local_positions(32, 2, r, "zigzag_docs", cu_seqlens=cu) for r in range(2)])
    assert sorted(pos.tolist()) == list(range(32))
    assert local_positions(32, 2, 0, "zigzag_docs", cu_seqlens=cu).tolist() == [
        0,
        1,
        6,
        7,
        8,
        9,
        10,
        11,
        20,
        21,
        22,
        23,
        24,
        25,
        30,
        31,
    ]
    x = torch.arange(32)[None]
    assert torch.equal(shard(x, layout="zigzag_docs", cu_seqlens=cu), x)  # one process: the whole tensor
    assert torch.equal(gather(x, layout="zigzag_docs", cu_seqlens=cu), x)
    with pytest.raises(ValueError, match="multiple of 2\\*P = 4"):
        local_positions(32, 2, 0, "zigzag_docs", cu_seqlens=[0, 6, 32])
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        local_positions(32, 2, 0, "zigzag_docs")


def test_one_rank_packed_and_windowed():
    """No process group: the tiled single-device path, forward and backward, against the reference."""
    rng = random.Random(5)
    for causal in (False, True):
        for kw in (
            dict(cu_seqlens=documents(40, 10, rng)),
            dict(window=(5, 2)),
            dict(cu_seqlens=[0, 7, 30, 40], window=(4, -1)),
        ):
            case = dict(
                B=2, s=40, H=4, Hkv=2, d=16, dtype="float64", causal=causal, layout="contiguous", strategy="auto", **kw
            )
            cases.check_case(0, 1, case)


def test_longer_packed_sequences(pools):
    """Many rows per block: tiles of several hundred rows, the window tiling (512-row tiles) and documents
    spanning ranks, float32."""
    S, P = 2048, 2
    rng = random.Random(3)
    cu = [0] + sorted(rng.sample(range(1, S), 12)) + [S]
    masks = (dict(cu_seqlens=cu), dict(window=(700, 300)), dict(cu_seqlens=cu, window=(100, 100)))
    todo = [  # each strategy under every mask, causal (zigzag) and not (contiguous) alternating
        dict(B=1, s=S // P, H=4, Hkv=2, d=32, dtype="float32", causal=c, layout=lay, strategy=st, seed=2, **kw)
        for i, st in enumerate(("token_ring:direct,c=2,k=1", "ring", "ulysses"))
        for j, kw in enumerate(masks)
        for c, lay in [((False, "contiguous"), (True, "zigzag"))[(i + j) % 2]]
    ]
    pools(P).run(cases.check_many, todo)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=st.integers(1, 80), data=st.data())
def test_tiles_cover_exactly_the_visible_pairs(S, data):
    """Whatever the documents, window and (sorted) positions: the tiles' query rows are disjoint, every
    visible pair lies in exactly one tile, a full/causal tile holds only visible pairs, and a mask tile's mask
    is the visible set."""
    causal = data.draw(st.booleans())
    cuts = data.draw(st.lists(st.integers(1, max(1, S - 1)), max_size=6)) if S > 1 else []
    cu = [0] + sorted(set(c for c in cuts if 0 < c < S)) + [S]
    window = data.draw(st.one_of(st.none(), st.tuples(st.integers(-1, S + 2), st.integers(-1, S + 2))))
    m = make_mask(S, cu, window, causal)
    if m is None:
        return
    qpos = torch.tensor(sorted(data.draw(st.sets(st.integers(0, S - 1), min_size=1))))
    kpos = torch.tensor(sorted(data.draw(st.sets(st.integers(0, S - 1), min_size=1))))
    want = cases.allowed(S, causal, cu, window)[qpos][:, kpos]
    got = torch.zeros_like(want, dtype=torch.int64)
    rows = torch.zeros(len(qpos), dtype=torch.int64)
    for t in tiles(m, qpos, kpos):
        rows[t.q0 : t.q1] += 1
        block = want[t.q0 : t.q1, t.k0 : t.k1]
        if t.kind == "full":
            assert block.all()
            got[t.q0 : t.q1, t.k0 : t.k1] += 1
        elif t.kind == "causal":
            assert torch.equal(qpos[t.q0 : t.q1], kpos[t.k0 : t.k1])
            tri = torch.ones_like(block).tril()
            assert torch.equal(block, tri)
            got[t.q0 : t.q1, t.k0 : t.k1] += tri.long()
        else:
            assert torch.equal(t.mask(m, qpos, kpos), block)
            got[t.q0 : t.q1, t.k0 : t.k1] += block.long()
    assert rows.max() <= 1
    assert torch.equal(got, want.long())
    assert torch.equal(visible(m, qpos, kpos), want)


def test_plain_arguments_make_no_mask():
    """One document and windows that cut nothing run the unmasked schedules (and their fast kernels)."""
    assert make_mask(64, None, None, True) is None
    assert make_mask(64, [0, 64], (-1, -1), False) is None
    assert make_mask(64, [0, 0, 64, 64], (63, 100), False) is None
    assert make_mask(64, None, (-1, 5), True) is None  # causal caps the right side at 0
    assert make_mask(64, None, (10, -1), True) is not None
    assert make_mask(64, None, (-1, 0), False) is not None  # non-causal right=0 is a mask of its own


@pytest.mark.parametrize("P", [2, 3, 4])
def test_skipped_blocks_save_bytes_and_the_simulator_knows(pools, P):
    """16 equal documents: each rank's shard meets few others, so the schedules send a fraction of the
    unpacked bytes; the bytes each rank really sent equal the simulator's per pass, packed or not."""
    from test_sim import flat_kernel

    from tokenring.schedules import Shapes
    from tokenring.sim.simulator import simulate
    from tokenring.sim.topology import MeshTopology

    s = 16
    S = s * P
    cu = list(range(0, S + 1, S // 16)) if S % 16 == 0 else [0, 3, S // 2, S]
    for causal in (False, True):
        layout = "zigzag" if causal else "contiguous"
        mask = make_mask(S, cu, None, causal)
        for name in ("token_ring:relay", "token_ring:direct,c=2,k=1", "ring", "ring:direct,c=2,k=1", "ulysses"):
            if why_not(name, 4, 2, P):
                continue
            sent = {}
            for packed in (False, True):
                case = dict(
                    B=1,
                    s=s,
                    H=4,
                    Hkv=2,
                    d=16,
                    dtype="float32",
                    causal=causal,
                    layout=layout,
                    strategy=name,
                    **({"cu_seqlens": cu} if packed else {}),
                )
                logs = pools(P).run(cases.comm_log_case, case)
                sim = simulate(
                    name,
                    Shapes(1, s, 4, 2, 16, torch.float32, P),
                    MeshTopology("m", P, link_bw=1e9),
                    flat_kernel(),
                    causal=causal,
                    layout=layout,
                    backward=True,
                    mask=mask if packed else None,
                )
                for i, what in enumerate(("forward", "backward")):
                    per_rank = [
                        sum(r["bytes"] for w, recs in log if w.endswith(what) for r in recs if r["direction"] == "send")
                        for log in logs
                    ]
                    assert max(per_rank) == sim.passes[i].bytes_per_rank, (name, packed, what, per_rank)
                sent[packed] = sum(
                    r["bytes"] for log in logs for _, recs in log for r in recs if r["direction"] == "send"
                )
            if name == "ulysses":
                assert sent[True] == sent[False]  # all-to-alls move every row whatever the mask
            else:
                assert sent[True] < 0.75 * sent[False], (name, causal, sent)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("cu_sum", "add up to S"),
        ("cu_ranks_differ", "cu_seqlens / window"),
        ("cu_bad_on_one_rank", "non-decreasing"),
        ("window_bad", "each side must be >= 0"),
    ],
)
def test_bad_packing_raises_value_error_on_every_rank(pools, kind, needle):
    msgs = pools(3).run(cases.expect_error, kind)
    if kind == "cu_bad_on_one_rank":  # rank 0 says what is wrong, the others that rank 0 refused
        assert needle in msgs[0], msgs[0]
        assert all("rank(s) [0] refused" in m for m in msgs[1:]), msgs
    else:
        for msg in msgs:
            assert needle in msg, msg


def test_schedule_skips_documents_that_never_meet():
    """Two documents, each inside one rank's contiguous shard: no rank needs another's rows."""
    from tokenring.strategies import get

    mask = make_mask(32, [0, 16, 32], None, False)
    for name in ("token_ring:relay", "ring", "token_ring:direct,c=2,k=1"):
        sched = get(name).schedule(2, "contiguous", False, True, mask)
        assert not any(st.messages for st in sched.steps), name
        assert all(c.q_owner == c.kv_owner == c.rank for st in sched.steps for c in st.computes), name


def test_fractional_or_nested_document_bounds_and_windows_are_refused():
    """4.5 tokens would silently become 4 (other documents than the caller meant): whole numbers only, of any
    numeric type; a nested list or a bool is refused too."""
    assert make_mask(16, [0.0, 4.0, 16.0], None, True) == make_mask(16, [0, 4, 16], None, True)
    assert make_mask(16, [torch.tensor(0), torch.tensor(4), 16], None, True) is not None
    for cu in ([0, 4.5, 16], [[0, 4, 16]], [0, True, 16]):
        with pytest.raises(ValueError, match="whole numbers"):
            make_mask(16, cu, None, True)
    for window in ((1.5, 2), ("a", 1), (1,)):
        with pytest.raises(ValueError, match="window must be a pair"):
            make_mask(16, None, window, False)


def test_batched_shard_pairs_equal_the_pairwise_ones():
    """The schedule asks every (q owner, kv owner) pair which rows meet; the batched answer per q owner equals
    Mask.pair on the two shards, for random documents and windows, every layout, P up to 9."""
    import random

    from tokenring.masks import _positions, make_mask, shard_pair

    rng = random.Random(3)
    for trial in range(60):
        P = rng.randint(1, 9)
        layout = rng.choice(["contiguous", "zigzag", "zigzag_docs"])
        s = 2 * P * rng.randint(1, 3) if layout == "zigzag_docs" else rng.randint(1, 6) * 2
        S = s * P
        unit = 2 * P if layout == "zigzag_docs" else 1
        cuts = sorted(rng.sample(range(1, S // unit), min(rng.randint(0, 4), S // unit - 1))) if S // unit > 1 else []
        cu = [0] + [c * unit for c in cuts] + [S]
        window = rng.choice([None, (rng.randint(0, 5), -1), (rng.randint(0, 3), rng.randint(0, 3))])
        causal = rng.random() < 0.5
        mask = make_mask(S, cu, window, causal, force=True)
        for i in range(P):
            for j in range(P):
                want = mask.pair(_positions(mask, P, layout, i), _positions(mask, P, layout, j))
                assert shard_pair(mask, P, layout, i, j) == want, (trial, P, layout, cu, window, causal, i, j)
