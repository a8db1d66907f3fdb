"""Single-process unit tests: merge math, kernels, layouts and schedule invariants."""

import itertools

import pytest
import torch
from cases import reference

from tokenring.kernels import block_backward, block_forward
from tokenring.layouts import global_order, local_positions
from tokenring.merge import merge_, new_accumulator
from tokenring.schedules import block_pair
from tokenring.strategies import get


def test_merge_exact_and_inf_safe():
    torch.manual_seed(0)
    B, n, H, d = 2, 5, 3, 4
    s = torch.randn(B, H, n, 6, dtype=torch.float64)
    v = torch.randn(B, 6, H, d, dtype=torch.float64)

    def part(cols):
        lse = torch.logsumexp(s[..., cols], -1)
        o = torch.einsum("bhnk,bkhd->bnhd", torch.softmax(s[..., cols], -1), v[:, cols])
        return o, lse

    o, lse = new_accumulator(B, n, H, d, torch.float64, "cpu")
    for cols in ([0, 1], [2, 3, 4], [5]):
        merge_(o, lse, *part(cols))
    want_o, want_lse = part(list(range(6)))
    assert (o - want_o).abs().max() < 1e-12 and (lse - want_lse).abs().max() < 1e-12
    # Rows that saw no key on either side stay -inf with output 0, and merging them later is exact.
    o2, lse2 = new_accumulator(B, n, H, d, torch.float64, "cpu")
    empty_o, empty_lse = new_accumulator(B, n, H, d, torch.float64, "cpu")
    merge_(o2, lse2, empty_o, empty_lse)
    assert torch.isneginf(lse2).all() and (o2 == 0).all() and not torch.isnan(o2).any()
    merge_(o2, lse2, *part([0, 1]))
    assert (o2 - part([0, 1])[0]).abs().max() < 1e-12


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H,Hkv,d", [(4, 4, 16), (8, 2, 72), (3, 1, 5)])
def test_block_kernels(backend, causal, H, Hkv, d):
    torch.manual_seed(1)
    n, m = (9, 9) if causal else (7, 11)
    q = torch.randn(2, n, H, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, m, Hkv, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, m, Hkv, d, dtype=torch.float64, requires_grad=True)
    want = reference(q, k, v, causal, 0.37)
    o, lse = block_forward(q.detach(), k.detach(), v.detach(), causal, 0.37, backend=backend)
    assert (o - want).abs().max() < 1e-12
    dout = torch.randn_like(want)
    want.backward(dout)
    delta = (dout * want).sum(-1).transpose(1, 2)
    for out in (None, want.detach()):  # a fused kernel gets the real output, or one built from delta
        dq, dk, dv = block_backward(
            dout, q.detach(), k.detach(), v.detach(), lse, delta.detach(), causal, 0.37, backend=backend, out=out
        )
        for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            assert got.shape == ref.shape and (got - ref).abs().max() < 1e-11


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_block_backward_low_precision(dtype, tol, backend):
    """Both backward kernels in the input dtypes users train in, against float64 autograd; relative to the
    largest gradient entry. The fused kernel gets an output built from delta, as on a visiting block."""
    torch.manual_seed(3)
    q, k, v, dout = (torch.randn(2, 40, h, 24, dtype=torch.float64) for h in (6, 2, 2, 6))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    want = reference(qq, kk, vv, True, 0.3)
    want.backward(dout)
    lq, lk, lv, ldo = (t.to(dtype) for t in (q, k, v, dout))
    o, lse = block_forward(lq, lk, lv, True, 0.3)
    delta = (ldo.float() * o.float()).sum(-1).transpose(1, 2)
    got = block_backward(ldo, lq, lk, lv, lse, delta, True, 0.3, backend=backend)
    for g, ref in zip(got, (qq.grad, kk.grad, vv.grad)):
        assert ((g.double() - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_out_for_delta(dtype):
    """O' has row sums rowsum(dO * O') == delta, including zero rows, tiny rows (no underflow) and huge ones."""
    from tokenring.kernels import out_for_delta

    torch.manual_seed(4)
    dout = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    dout[0, 1] = 0.0  # rows with dO = 0: O' = 0
    dout[1, 2] *= 1e-30  # |dO|^2 underflows in float32
    dout[1, 3] *= 1e30
    delta = torch.randn(2, 3, 5, dtype=torch.float64) * dout.abs().amax(-1).transpose(1, 2)
    delta[0, :, 1] = 0.0
    dout = dout.to(dtype)
    o = out_for_delta(dout, delta)
    assert o.dtype == dtype and torch.isfinite(o).all()
    assert (o[0, 1] == 0).all()
    got = (dout.double() * o.double()).sum(-1).transpose(1, 2)
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert ((got - delta).abs() <= tol * delta.abs() + 1e-300).all()


def test_cpu_backward_choice(monkeypatch):
    """The CPU backward is measured per dtype unless forced; a bad override is an error naming the choices."""
    import tokenring.kernels.cpu as K
    from tokenring.kernels import cpu_backward_choice

    cpu_backward_choice.cache_clear()
    assert cpu_backward_choice(torch.float32, 8) == "cpu_flash"  # fused wherever measured, not timed per run
    for flags, want in (({"avx2", "avx512f"}, "math"), ({"avx512_bf16"}, "cpu_flash"), ({"amx_bf16"}, "cpu_flash")):
        monkeypatch.setattr(K, "_cpu_flags", lambda flags=flags: flags)
        cpu_backward_choice.cache_clear()
        assert cpu_backward_choice(torch.bfloat16, 8) == want, flags
    monkeypatch.setattr(K, "_cpu_flags", lambda: set())  # flags unknown: measured
    cpu_backward_choice.cache_clear()
    assert cpu_backward_choice(torch.float16, 8) in ("cpu_flash", "math")
    monkeypatch.setenv("TOKENRING_CPU_BACKWARD", "math")
    cpu_backward_choice.cache_clear()
    assert cpu_backward_choice(torch.float32, 8) == "math"
    monkeypatch.setenv("TOKENRING_CPU_BACKWARD", "fast")
    cpu_backward_choice.cache_clear()
    with pytest.raises(ValueError, match="cpu_flash"):
        cpu_backward_choice(torch.float32, 8)
    cpu_backward_choice.cache_clear()


def test_math_kernel_chunks_rows(monkeypatch):
    """Force tiny row chunks: the chunked math path must equal the one-chunk result."""
    import tokenring.kernels.reference as K

    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 13, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    o1, l1 = K.math_forward(q, k, v, True, 0.5)
    monkeypatch.setattr(K, "_MATH_CHUNK_ELEMS", 1)
    o2, l2 = K.math_forward(q, k, v, True, 0.5)
    assert (o1 - o2).abs().max() < 1e-13 and (l1 - l2).abs().max() < 1e-13


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_layouts_partition_sequence(P, layout):
    S = 4 * P * 3
    allpos = torch.cat([local_positions(S, P, r, layout) for r in range(P)])
    assert sorted(allpos.tolist()) == list(range(S))
    for r in range(P):
        pos = local_positions(S, P, r, layout)
        assert (pos[1:] > pos[:-1]).all(), "local order must be increasing (causal mask on own block)"
    assert torch.equal(global_order(S, P, layout), allpos)


def test_layout_rejects_indivisible():
    with pytest.raises(ValueError, match="divisible by 6"):
        local_positions(20, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="divisible by 3"):
        local_positions(20, 3, 0, "contiguous")


def _attended(P, layout, causal):
    """Ground truth: the (q token, kv token) pairs of the full mask, by global position."""
    S = 4 * P
    pos = [local_positions(S, P, r, layout).tolist() for r in range(P)]
    need = set()
    for j, r in itertools.product(range(P), range(P)):
        for a in pos[j]:
            for b in pos[r]:
                if not causal or b <= a:
                    need.add((a, b))
    return S, pos, need


def _variants(P: int) -> list[str]:
    names = ["token_ring:relay", "ring", "ring_bidir"]
    for c in (1, 2, 3):
        for k in range(1, max(2, P)):
            names += [f"token_ring:direct,c={c},k={k}", f"ring:direct,c={c},k={k}"]
    return names


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")])
def test_schedules_cover_each_pair_once(P, causal, layout):
    """For every schedule variant: every attended (query, key) pair is computed exactly once for each head
    half, no masked pair is computed, every compute has its inputs (rows and heads) on the rank that runs it
    (a message counts from the step after it is due), no message goes to its sender or is due before it is
    posted or after the last step."""
    from tokenring.schedules import covers, part_slice

    S, pos, need = _attended(P, layout, causal)
    need = {(a, b, h) for a, b in need for h in ("h0", "h1")}
    s = S // P
    for name in _variants(P):
        strat = get(name)
        for sched in (strat.forward_schedule(P, layout, causal), strat.backward_schedule(P, layout, causal)):
            seen = []
            have = {(r, kind, r, "all"): [("all", "all", -1)] for r in range(P) for kind in ("q", "qgrad", "kv")}

            def held(rank, kind, owner, heads, part, t):
                got = have.get((rank, kind, owner, heads), []) + have.get((rank, kind, owner, "all"), [])
                assert any(ready < t and covers(p, part) and h in ("all", heads) for p, h, ready in got), (
                    name,
                    sched.backward,
                    t,
                    rank,
                    kind,
                    owner,
                    heads,
                    part,
                    got,
                )

            for t, step in enumerate(sched.steps):
                for c in step.computes:
                    held(c.rank, sched.q_kind, c.q_owner, c.heads, c.q_part, t)
                    held(c.rank, "kv", c.kv_owner, c.heads, c.kv_part, t)
                    for a in pos[c.q_owner][part_slice(c.q_part, s)]:
                        for b in pos[c.kv_owner][part_slice(c.kv_part, s)]:
                            if (not c.diag) or b <= a:
                                seen += [(a, b, h) for h in (("h0", "h1") if c.heads == "all" else (c.heads,))]
                for m in step.messages:
                    assert m.src != m.dst
                    assert m.due == -1 or t <= m.due < len(sched.steps), (name, t, m)
                    have.setdefault((m.dst, m.kind, m.owner, m.heads), []).append((m.part, m.heads, max(t, m.due)))
            assert len(seen) == len(set(seen)), f"{name}: a pair was computed twice"
            assert set(seen) == need, name


def test_zigzag_pairs_are_half_blocks():
    P = 4
    for j, r in itertools.product(range(P), range(P)):
        q_part, kv_part, diag = block_pair(j, r, P, "zigzag", True)
        assert diag == (j == r)
        if j != r:
            assert (q_part == "all") != (kv_part == "all"), "off-diagonal zigzag pairs cost half a block"


@pytest.mark.parametrize("P", range(1, 10))
def test_pairings_meet_everyone_once(P):
    """Rounds of the direct schedules: each a set of pairs (partner of partner is oneself), every ordered pair of
    distinct ranks meets exactly once, P - 1 rounds for even P, P for odd (one bye each)."""
    from tokenring.schedules import pairings

    rounds = pairings(P)
    assert len(rounds) == (P - 1 if P % 2 == 0 else P) or P == 1
    met = [(r, j) for partner in rounds for r, j in enumerate(partner) if r != j]
    for partner in rounds:
        assert sorted(partner) == list(range(P)) and all(partner[partner[r]] == r for r in range(P))
    assert sorted(met) == [(r, j) for r in range(P) for j in range(P) if r != j]


@pytest.mark.parametrize("P", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_own_pieces_partition_the_block(P, c):
    """The own block's pieces tile its rows in order (head, one per bye round on odd P, tail unless nothing goes
    home), each non-empty from 2 local rows (even P) or 2c+1 (odd P) on: the lengths the equal cut accepted."""
    from tokenring.schedules import own_pieces, part_rows, rows

    for mover, backward, triangle in itertools.product(("q", "kv"), (False, True), (False, True)):
        pieces = own_pieces(c, P, mover, backward, triangle)
        tail = mover == "q" or backward
        assert len(pieces) == 1 + (c if P % 2 else 0) + tail
        assert pieces[0][0] == 0 and pieces[-1][1] == pieces[-1][2]
        assert all(b == a2 and n == n2 for (_, b, n), (a2, _, n2) in zip(pieces, pieces[1:]))
        for s in range(2 if P % 2 == 0 else 2 * c + 1, 70):
            assert all(part_rows(rows(a, b, n), s) > 0 for a, b, n in pieces), (mover, backward, triangle, s)


def test_own_pieces_follow_the_bytes():
    """Forward TokenRing: the head and the tail get equal compute (half the rows; on the causal diagonal, where
    rows [0, x) cost x**2, the cut near 1/sqrt(2)); its backward gives the head more (it waits for Q and dO,
    the tail only sends dQ); forward pass-KV returns nothing, so all own rows run first."""
    from tokenring.schedules import own_pieces

    assert own_pieces(2, 4) == [(0, 4, 8), (4, 8, 8)]
    assert own_pieces(2, 4, triangle=True) == [(0, 6, 8), (6, 8, 8)]
    assert own_pieces(2, 4, "q", backward=True)[0][1] / 8 > 0.6
    assert own_pieces(3, 4, "kv") == [(0, 1, 1)]
    assert own_pieces(2, 4, "kv", backward=True) == [(0, 4, 8), (4, 8, 8)]
    assert own_pieces(2, 5, "kv") == [(0, 3, 5), (3, 4, 5), (4, 5, 5)]  # no tail: its cell goes to the head
    assert own_pieces(2, 5, "q", backward=True) == [(0, 2, 5), (2, 3, 5), (3, 4, 5), (4, 5, 5)]


def test_direct_schedules_run_the_own_pieces():
    """The direct builder runs the own block as own_pieces cuts it: forward TokenRing half first and half last;
    forward pass-KV all of it at step 0 and nothing of its own later."""
    from tokenring.strategies.direct import direct

    def own(sched, r):
        return [
            (t, c.q_part)
            for t, st in enumerate(sched.steps)
            for c in st.computes
            if c.rank == r and c.q_owner == r and c.kv_owner == r
        ]

    for P in (2, 4):
        q = direct("token_ring:direct,c=2,k=1", P, "contiguous", False, False, "q", 2, 1)
        assert own(q, 1) == [(0, "lo"), (len(q.steps) - 1, "hi")]
        kv = direct("ring:direct,c=2,k=1", P, "contiguous", False, False, "kv", 2, 1)
        assert own(kv, 1) == [(0, "all")]


def test_explain_plan_prints_every_rank_and_step(capsys):
    """`tokenring explain --plan`: per step, what each rank computes, sends (bytes, due step) and receives; a family
    name is resolved first and says what it resolved to."""
    from tokenring.schedules import Shapes
    from tokenring.tools import explain

    assert (
        explain.main(
            [
                "--plan",
                "--strategy",
                "token_ring:direct,c=2,k=1",
                "--ranks",
                "3",
                "--seq",
                "24",
                "--heads",
                "4",
                "--head-dim",
                "8",
                "--causal",
                "--pass",
                "fwd",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    sched = get("token_ring:direct,c=2,k=1").forward_schedule(3, "zigzag", True)
    assert out.count("\nstep ") == len(sched.steps)
    assert all(f"rank {r}: compute" in out for r in range(3)) and "q(" in out and "out(" in out and "MB" in out
    assert "by step" in out  # partials due after the step that posts them
    assert sched.describe(Shapes(1, 8, 4, 4, 8, torch.bfloat16, 3)) in out
    explain.main(
        [
            "--plan",
            "--strategy",
            "token_ring",
            "--topology",
            "mesh:100mbit",
            "--ranks",
            "4",
            "--seq",
            "64",
            "--pass",
            "fwd",
        ]
    )
    assert "token_ring -> token_ring:" in capsys.readouterr().out


def test_compiled_merge_matches_eager():
    """The fused (torch.compile) merge used on CUDA gives the eager result on strided accumulator views,
    -inf rows included. Run on CPU here (it needs a C compiler; skipped without one)."""
    import shutil

    if not (shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("torch.compile needs a C compiler on CPU")
    torch.manual_seed(5)
    for n in (6, 9):  # two shapes: dynamic shapes, no recompile-per-shape failure
        big_o, big_l = new_accumulator(2, 2 * n, 4, 8, torch.bfloat16, "cpu")
        merge_(big_o, big_l, torch.randn(2, 2 * n, 4, 8).to(torch.bfloat16), torch.randn(2, 4, 2 * n))
        o, lse = torch.randn(2, n, 2, 8).to(torch.bfloat16), torch.randn(2, 2, n)
        lse[0, 0, 1] = float("-inf")
        want_o, want_l = big_o.clone(), big_l.clone()
        merge_(want_o[:, n:, 2:], want_l[:, 2:, n:], o, lse, compiled=False)
        merge_(big_o[:, n:, 2:], big_l[:, 2:, n:], o, lse, compiled=True)
        assert torch.allclose(big_o, want_o, rtol=1e-6, atol=1e-6) and torch.allclose(big_l, want_l, rtol=1e-6)
        assert not torch.isnan(big_o).any()


@pytest.mark.parametrize("name", ["token_ring:direct,c=2,k=2", "ring:direct,c=1,k=3", "double_ring:direct,c=2,k=1,n=2"])
def test_early_receives_keep_tags_and_pair_order(name):
    """``Schedule.postings``: a returning partial (``ready``) is received from the step its rows left, with
    the tag key ``(step posted, n)`` both ends derive alike; without early receives (NCCL, which matches a
    pair's operations in posting order) every receive is posted at its message's step, in the sender's order."""
    from tokenring.strategies import get

    P = 4
    for backward in (False, True):
        sched = get(name).schedule(P, "zigzag", True, backward)
        sent = {r: [(m, at) for step in sched.postings(r) for m, *at in step[1]] for r in range(P)}
        for early in (True, False):
            got = {
                r: [(m, at, t) for t, step in enumerate(sched.postings(r, early)) for m, *at in step[2]]
                for r in range(P)
            }
            for r in range(P):
                for p in range(P):
                    keys_sent = [tuple(at) for m, at in sent[p] if m.dst == r]
                    keys_got = [tuple(at) for m, at, _ in got[r] if m.src == p]
                    assert sorted(keys_sent) == sorted(keys_got) and len(set(keys_got)) == len(keys_got)
                    if not early:
                        assert keys_got == keys_sent  # same order on both ends
                for m, (posted, _), t in got[r]:
                    assert t == (min(m.ready, posted) if early and m.ready >= 0 else posted)
        rets = [m for st in sched.steps for m in st.messages if m.kind in ("out", "dq", "dkv") and m.ready >= 0]
        assert rets or (not name.startswith("token_ring") and not backward)  # pass-KV forward returns nothing


def test_zero_chunks_or_lookahead_are_refused_when_named():
    for spec in ("token_ring:direct,c=0,k=1", "ring:direct,c=2,k=0"):
        with pytest.raises(ValueError, match="at least one chunk"):
            get(spec)


def test_identity_cache_never_serves_a_changed_or_new_tensor():
    """Value reads cached per tensor (a model's layers share their documents) are never reused for a tensor
    changed in place, a new tensor that got a freed one's id, or an inference tensor (no version counter)."""
    from tokenring.ops import IdentityCache

    cache = IdentityCache(size=4)
    t = torch.tensor([0, 3, 8])
    cache.put([t, None], "docs")
    assert cache.get([t, None]) == "docs"
    t.add_(0)  # bumps the version: the values may differ now
    assert cache.get([t, None]) is None
    cache.put([t, None], "again")
    ident = id(t)
    del t
    u = torch.tensor([0, 4, 8])  # may reuse the id; the weak reference tells them apart
    assert cache.get([u, None]) is None or id(u) != ident
    with torch.inference_mode():
        w = torch.tensor([0, 8])
        cache.put([w], "x")
        assert cache.get([w]) is None


def test_one_rank_masks_and_sinks_under_inference_mode():
    import tokenring

    q = torch.randn(1, 12, 4, 8)
    cu = torch.tensor([0, 5, 12])
    with torch.inference_mode():
        a = tokenring.attention(q, q, q, causal=True, cu_seqlens=cu, sinks=torch.zeros(4))
    b = tokenring.attention(q, q, q, causal=True, cu_seqlens=cu, sinks=torch.zeros(4))
    assert torch.equal(a, b)


def test_bad_sinks_are_refused():
    import pytest

    import tokenring

    q = torch.randn(1, 8, 4, 8)
    for bad, needle in (
        (torch.zeros(3), "shape \\(4,\\)"),
        (torch.zeros(4, dtype=torch.int64), "floating"),
        (torch.zeros(4, device="meta"), "one device"),
    ):
        with pytest.raises(ValueError, match=needle):
            tokenring.attention(q, q, q, sinks=bad)


def test_a_kernel_backend_is_one_registry_entry(monkeypatch):
    """A backend added to kernels.REGISTRY runs every block it says it supports (forward and backward), and the
    blocks it refuses go to the next backend; a single rank with documents runs through it too."""
    import tokenring
    from tokenring import kernels
    from tokenring.kernels.reference import Math

    calls = []

    class Counting(Math):
        name = "counting"

        def supports(self, q, mask, backward):
            return q.dtype == torch.float64

        def forward(self, *a, **kw):
            calls.append("fwd")
            return super().forward(*a, **kw)

        def backward(self, *a, **kw):
            calls.append("bwd")
            return super().backward(*a, **kw)

    monkeypatch.setattr(kernels, "REGISTRY", {"counting": Counting(), **kernels.REGISTRY})
    assert kernels.pick(torch.zeros(1, 2, 1, 4)).name == "cpu_flash"  # float32: refused, the next one takes it
    q, k, v = (torch.randn(1, 8, h, 4, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = tokenring.attention(q, k, v, causal=True, cu_seqlens=torch.tensor([0, 3, 8]))
    out.sum().backward()
    assert "fwd" in calls and "bwd" in calls, calls
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                *(t[:, a:b].transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
            for a, b in ((0, 3), (3, 8))
        ],
        dim=1,
    )
    assert (out - ref).abs().max() < 1e-12


def test_checksum_of_large_and_permuted_values():
    """agreement.checksum: the same number for equal tensors whatever their values' size, another for a
    permutation, a one-unit change, a dtype or a shape."""
    from tokenring.agreement import checksum

    x = torch.tensor([[2**63 - 1, -(2**63), 5, 7]])
    assert checksum(x) == checksum(x.clone())
    assert len({checksum(x), checksum(x.flip(-1)), checksum(x + (x == 5)), checksum(x.view(2, 2))}) == 4
    f = torch.randn(3, 5)
    assert checksum(f) == checksum(f.clone()) != checksum(f.double()) and checksum(f) != checksum(-f)


def test_stacked_merge_equals_merging_one_by_one():
    """merge_stacked (decode's one-pass merge of every rank's partial) against merge_ in turn, float64: rows that
    some partials never saw (lse -inf), and a row that none saw (0 and -inf, never NaN)."""
    from tokenring.merge import merge_, merge_stacked, new_accumulator

    g = torch.Generator().manual_seed(0)
    n, B, rows, H, d = 5, 2, 3, 4, 7
    o = torch.randn(n, B, rows, H, d, generator=g, dtype=torch.float64)
    lse = torch.randn(n, B, H, rows, generator=g, dtype=torch.float64) * 5
    lse[1:3, :, :, 0] = float("-inf")  # row 0: two partials saw no key
    lse[:, 1, 2, 2] = float("-inf")  # batch 1, head 2, row 2: no partial saw a key
    o[:, 1, 2, 2] = 0.0
    want_o, want_lse = new_accumulator(B, rows, H, d, torch.float64, "cpu")
    for j in range(n):
        merge_(want_o, want_lse, o[j], lse[j])
    got_o, got_lse = merge_stacked(o, lse)
    assert torch.allclose(got_o, want_o, atol=1e-13, rtol=0) and torch.equal(got_lse.isneginf(), want_lse.isneginf())
    finite = want_lse.isfinite()
    assert torch.allclose(got_lse[finite], want_lse[finite], atol=1e-13, rtol=0)
    assert not got_o.isnan().any() and got_o[1, 2, 2].abs().max() == 0


def test_merge_of_seen_rows_equals_the_guarded_merge():
    """merge_seen_ (attention without a mask: every partial's rows saw a key) against merge_eager_, float64,
    from an empty accumulator through four partials of widely different log-sum-exps."""
    from tokenring.merge import merge_eager_, merge_seen_, new_accumulator

    g = torch.Generator().manual_seed(1)
    want, got = (new_accumulator(2, 5, 3, 7, torch.float64, "cpu") for _ in range(2))
    for scale in (1.0, 30.0, 0.1, 8.0):
        o = torch.randn(2, 5, 3, 7, generator=g, dtype=torch.float64)
        lse = torch.randn(2, 3, 5, generator=g, dtype=torch.float64) * scale
        merge_eager_(*want, o, lse)
        merge_seen_(*got, o, lse)
        assert torch.allclose(got[0], want[0], atol=1e-13, rtol=0) and torch.allclose(got[1], want[1], atol=1e-12)


def test_rows_every_query_sees_take_one_kernel_call(monkeypatch):
    """extend.attend_rows: a decode step's single new token stored on this rank, with cached rows before it, is
    one kernel call over all the rows (not a call per part and a merge), exact against the float64 softmax;
    several new tokens still attend the stored ones causally."""
    import tokenring.kernels as kernels
    from tokenring.extend import RowMask, attend_rows

    calls = []

    class Counting(kernels.CpuFlash):
        name = "counting"

        def forward(self, *a, **kw):
            calls.append(1)
            return super().forward(*a, **kw)

    monkeypatch.setattr(kernels, "REGISTRY", {"counting": Counting(), **kernels.REGISTRY})
    monkeypatch.setattr(kernels, "_picked", {})
    g = torch.Generator().manual_seed(3)
    for t, (a, b), want in ((1, (0, 1), 1), (3, (0, 1), 1), (3, (1, 3), 2)):  # (the cached rows, the causal square)
        calls.clear()
        q = torch.randn(2, t, 6, 12, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, 9 + b - a, 2, 12, generator=g, dtype=torch.float64) for _ in "kv")
        o, lse = attend_rows(q, 0, k, v, None, a, b, 0, RowMask(), 12**-0.5)
        assert len(calls) == want, (t, a, b, calls)
        ok = torch.ones(t, k.shape[1], dtype=torch.bool)  # query i sees the cached rows and new tokens j <= i
        ok[:, 9:] = torch.arange(a, b)[None, :] <= torch.arange(t)[:, None]
        kk, vv = (x.repeat_interleave(3, 2) for x in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 12**-0.5
        ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~ok, float("-inf")), -1), vv)
        assert (o - ref).abs().max() < 1e-12
        assert (lse - torch.logsumexp(s.masked_fill(~ok, float("-inf")), -1)).abs().max() < 1e-12
