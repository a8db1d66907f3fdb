"""Sequences of any length: ``tokenring.shard`` cuts them unevenly and ``tokenring.attention`` (``seq_len=``, or a
``cu_seqlens`` list ending at the length) pads them internally; exact against float64, forward and backward."""

import cases
import pytest
import torch

import tokenring
from tokenring.layouts import padded_length, shard_positions

STRATS = ("token_ring", "ring", "ring_bidir")


def _grid(P: int, lengths) -> list[dict]:
    out = []
    for i, S in enumerate(lengths):
        for causal in (True, False):
            out.append(dict(S=S, H=4, Hkv=2, d=5, causal=causal, strategy=STRATS[(i + causal) % len(STRATS)]))
    return out


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_short_lengths_are_exact(pools, P):
    """S = 1, 2, 5 and one more than a multiple of 2P: some ranks hold no row at all."""
    grid = _grid(P, [1, 2, 5, 2 * P + 1])
    for errs in pools(P).run(cases.any_length_case, grid):
        assert max(errs) < 1e-10, list(zip(grid, errs))


@pytest.mark.parametrize("P", [2, 3, 5])
def test_documents_windows_sinks_at_odd_lengths(pools, P):
    """Documents of 1, 3 and 7 tokens among others, a window, sinks, GQA, both layouts, ulysses too."""
    grid = [
        dict(S=37, H=4, Hkv=2, d=5, causal=True, strategy="token_ring", cu_seqlens=[0, 1, 4, 11, 30, 37]),
        dict(S=29, H=4, Hkv=4, d=3, causal=False, strategy="ring", cu_seqlens=[0, 7, 8, 11, 29]),
        dict(S=31, H=4, Hkv=2, d=5, causal=True, strategy="token_ring", window=(6, 0), sinks=True),
        dict(S=23, H=4, Hkv=2, d=5, causal=False, strategy="token_ring", window=(3, 2), layout="zigzag"),
        dict(S=19, H=4, Hkv=2, d=5, causal=True, strategy="ring", layout="contiguous", sinks=True),
    ]
    if P != 3:
        grid.append(dict(S=27, H=P * 2, Hkv=P, d=5, causal=True, strategy="ulysses"))
    for errs in pools(P).run(cases.any_length_case, grid):
        assert max(errs) < 1e-10, list(zip(grid, errs))


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 5])  # P = 3 and 4: the short odd lengths above
def test_lengths_4095_and_4097(pools, P):
    grid = [
        dict(S=4095, H=2, Hkv=1, d=3, causal=True, strategy="token_ring", cu_seqlens=[0, 1, 4, 11, 2000, 4095]),
        dict(S=4097, H=2, Hkv=2, d=3, causal=False, strategy="ring"),
    ]
    for errs in pools(P).run(cases.any_length_case, grid):
        assert max(errs) < 1e-10, list(zip(grid, errs))


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_any_rows_per_rank_without_order(pools, P):
    """Non-causal attention without documents or a window over shards of any sizes (``rows=``), zero rows on
    some ranks, one rank holding everything, sinks, GQA, odd head dims, every flat strategy and auto."""
    strats = ("token_ring", "ring", "ring_bidir", "auto")
    shapes = [
        [5 + 3 * r for r in range(P)],  # growing
        [0] * (P - 1) + [7],  # one rank holds every row
        [2 * P + 1 - r if r % 2 else 0 for r in range(P)],  # every other rank empty
        [8 + (r == 0) for r in range(P)],  # text + image streams each split alone: one extra row on rank 0
    ]
    grid = [
        dict(rows=rows, H=4, Hkv=2 if i % 2 else 4, d=5 if i % 2 else 3, strategy=strats[i % 4], sinks=i == 2)
        for i, rows in enumerate(shapes)
    ]
    if P != 3:
        grid.append(dict(rows=shapes[0], H=2 * P, Hkv=P, d=5, strategy="ulysses"))
    for errs in pools(P).run(cases.ragged_case, grid):
        assert max(errs) < 1e-10, list(zip(grid, errs))


def test_any_rows_per_rank_refused_on_every_rank(pools):
    for r in pools(3).run(cases.ragged_refused):
        assert "rows=[3, 3, 3] gives rank 1 3" in r["mismatch"] or "rank(s) [1] refused" in r["mismatch"], r
        assert "no order: not causal" in r["causal"], r
        assert "rank 2" in r["differ"], r


def test_shard_positions_cover_the_sequence_once():
    for P in range(1, 6):
        for layout in ("contiguous", "zigzag"):
            for S in (1, 2, 3, 5, 7, 2 * P, 2 * P + 1, 61):
                held = [shard_positions(S, P, r, layout) for r in range(P)]
                assert sorted(torch.cat(held).tolist()) == list(range(S)), (P, layout, S)
                assert all(torch.all(h[1:] > h[:-1]) for h in held if len(h) > 1)
                assert padded_length(S, P, layout) >= S


def test_wrong_rows_for_the_length_are_refused():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="must be at least 1"):
        tokenring.attention(q, q, q, seq_len=0)
    with pytest.raises(ValueError, match="must agree"):
        tokenring.attention(q, q, q, seq_len=5, cu_seqlens=[0, 4])


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_balanced_layout_is_exact(pools, P):
    """layout="balanced" (the planner's chunks) over packed documents, even and odd lengths, short and past the
    16-chunks-per-rank threshold, causal or not, a window: every rank's rows and the gathered output."""
    long = 130 * P + 3  # over 128 * P: 16 chunks per rank, then padded
    grid = [
        dict(S=5, H=4, Hkv=2, d=5, causal=True, strategy="token_ring", cu_seqlens=[0, 1, 3, 5]),
        dict(S=1, H=4, Hkv=2, d=5, causal=False, strategy="ring", cu_seqlens=[0, 1]),
        dict(S=37, H=4, Hkv=2, d=5, causal=True, strategy="ring_bidir", cu_seqlens=[0, 1, 4, 11, 30, 37]),
        dict(S=long, H=4, Hkv=2, d=3, causal=True, strategy="token_ring", cu_seqlens=[0, 7, 10 * P, 90 * P, long]),
        dict(S=long, H=4, Hkv=4, d=3, causal=False, strategy="ring", cu_seqlens=[0, long - 1, long], window=(9, 4)),
        dict(S=256 * P, H=4, Hkv=2, d=3, causal=True, strategy="auto", cu_seqlens=[0, 3, 100 * P, 256 * P]),
    ]
    for g in grid:
        g["layout"] = "balanced"
    for errs in pools(P).run(cases.any_length_case, grid):
        assert max(errs) < 1e-10, list(zip(grid, errs))


def _packing(S: int, rng, median: int, sigma: float) -> list[int]:
    """``cu_seqlens`` of ``S`` tokens of log-normal document lengths, the last one cut at the end."""
    import numpy as np

    cu = [0]
    while cu[-1] < S:
        cu.append(min(S, cu[-1] + int(np.clip(rng.lognormal(np.log(median), sigma), 1, 16384))))
    return cu


def _held_once_in_order(S: int, P: int, layout: str, cu: list[int]) -> list[torch.Tensor]:
    """Every rank's positions under ``layout``, checked: S/P each, increasing, every token once."""
    from tokenring.layouts import local_positions

    held = [local_positions(S, P, r, layout, cu_seqlens=cu) for r in range(P)]
    assert sorted(torch.cat(held).tolist()) == list(range(S))
    assert all(len(h) == S // P and torch.all(h[1:] > h[:-1]) for h in held)
    return held


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_whole_docs_layout_is_exact(pools, P):
    """layout="whole_docs": short documents whole on one rank, long ones split over several (zigzag within the
    document), documents cut to fill the ranks; causal or not, windows, sinks, any length."""
    S, long = 40 * P, 40 * P + 3
    grid = [
        dict(S=S, H=4, Hkv=2, d=5, causal=True, strategy="token_ring", cu_seqlens=[0, 3, 9, 30, 31, S - 5, S]),
        dict(S=S, H=4, Hkv=2, d=5, causal=True, strategy="ring", cu_seqlens=[0, 47, 49, S], window=(6, 0)),
        dict(S=long, H=4, Hkv=2, d=3, causal=True, strategy="ring_bidir", cu_seqlens=[0, 7, 10, 60, long]),
        dict(
            S=long,
            H=4,
            Hkv=4,
            d=3,
            causal=False,
            strategy="token_ring",
            cu_seqlens=[0, 5, long - 1, long],
            window=(9, 4),
        ),
        dict(S=S, H=4, Hkv=2, d=3, causal=True, strategy="auto", cu_seqlens=[0, 3, S // 2, S], sinks=True),
        dict(S=5, H=4, Hkv=2, d=5, causal=True, strategy="token_ring", cu_seqlens=[0, 1, 3, 5]),
    ]
    for g in grid:
        g["layout"] = "whole_docs"
    for errs in pools(P).run(cases.any_length_case, grid):
        assert max(errs) < 1e-10, list(zip(grid, errs))


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_auto_layout_is_exact(pools, P):
    """layout="auto" at shard, attention and gather: every placement it can choose (forced per case, on
    documents no other case uses, so no cached plan answers), and the cost model's own choice; causal or not,
    windows, sinks, any length."""
    S, odd = 36 * P, 36 * P + 5
    grid = [
        dict(S=S, H=4, Hkv=2, d=5, causal=True, strategy="token_ring", cu_seqlens=[0, 4 + i, 11, S - 6, S], pick=pick)
        for i, pick in enumerate(("zigzag", "contiguous", "balanced", "whole_docs"))
    ] + [
        dict(S=odd, H=4, Hkv=2, d=3, causal=True, strategy="ring", cu_seqlens=[0, 9, 13, odd], window=(5, 0),
             pick="whole_docs"),
        dict(S=odd, H=4, Hkv=4, d=3, causal=False, strategy="token_ring", cu_seqlens=[0, 2, odd - 3, odd],
             pick="balanced", sinks=True),
        dict(S=S, H=4, Hkv=2, d=3, causal=True, strategy="auto", cu_seqlens=[0, 5, S // 3, S]),
        dict(S=odd, H=4, Hkv=2, d=3, causal=True, strategy="ring", cu_seqlens=[0, odd]),
    ]  # fmt: skip
    got = pools(P).run(cases.auto_layout_case, grid)
    for per_rank in got:
        assert max(e for e, _ in per_rank) < 1e-10, list(zip(grid, per_rank))
    chosen = [c for _, c in got[0]]
    assert chosen[:6] == [g["pick"] for g in grid[:6]], chosen
    assert chosen[7] == "zigzag" and all([c for _, c in r] == chosen for r in got), got  # one document: zigzag


def test_auto_layout_choice():
    """The cost model's choice: the fastest predicted placement, a later candidate only when over TIE faster;
    zigzag for one document; a change of topology re-decides; a bad packing is a ValueError naming it."""
    import numpy as np

    from tokenring import configure
    from tokenring.layouts import resolve_layout
    from tokenring.sim.placement import CANDIDATES, TIE, placement_times

    def fastest(times):
        best = CANDIDATES[0]
        for c in CANDIDATES[1:]:
            best = c if times[c] < times[best] * (1 - TIE) else best
        return best

    rng = np.random.default_rng(3)
    for P in (2, 4, 8):
        for _ in range(3):
            S = 4096 * P
            cu = _packing(S, rng, 600, 1.6)
            assert resolve_layout("auto", S, P, cu) == fastest(placement_times(S, P, tuple(cu))), (P, cu)
    assert resolve_layout("auto", 4096, 4, [0, 4096]) == resolve_layout("auto", 4096, 4, None) == "zigzag"
    assert resolve_layout("contiguous", 64, 4, [0, 3, 64]) == "contiguous"
    S, cu = 4 * 4096, _packing(4 * 4096, rng, 600, 1.6)
    try:
        configure(topology="mesh:200mbit")
        assert resolve_layout("auto", S, 4, cu) == fastest(placement_times(S, 4, tuple(cu)))
    finally:
        configure(topology=None)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        resolve_layout("auto", 100, 4, [0, 50, 90])
    assert resolve_layout("auto", 100, 4, None) == "zigzag"  # (internal callers: a batch with no packing)


def test_auto_layout_needs_the_documents_at_every_entry_point():
    """shard, gather, the position maps and attention refuse layout="auto" without cu_seqlens: a batch sharded
    with its documents and gathered without them would come back in the wrong order."""
    import tokenring
    from tokenring.layouts import global_order, local_positions, shard_positions

    x = torch.randn(1, 12, 2, 4)
    for call in (
        lambda: tokenring.shard(x, 1, "auto"),
        lambda: tokenring.gather(x, 1, "auto"),
        lambda: local_positions(12, 2, 0, "auto"),
        lambda: shard_positions(13, 2, 1, "auto"),
        lambda: global_order(12, 2, "auto"),
        lambda: tokenring.attention(x, x, x, causal=True, layout="auto"),
    ):
        with pytest.raises(ValueError, match="needs cu_seqlens"):
            call()
    assert torch.equal(tokenring.shard(x, 1, "auto", cu_seqlens=[0, 12]), x)  # one process: the whole tensor
    assert torch.equal(local_positions(12, 2, 1, "auto", cu_seqlens=[0, 12]), local_positions(12, 2, 1, "zigzag"))


def test_whole_docs_plan_keeps_documents_whole():
    """Each rank holds S/P tokens in increasing order, every token once. A document is cut only when it is over
    the split threshold (longer than S/P or over WHOLE_DOC_SHARE of a rank's mean work), or to fill ranks: each
    such cut empties one rank's room, so at most P - 1 of them. The busiest rank's causal work is at most the mean
    (and 5%) plus the largest work one document puts on one rank: the bound of dealing the largest first to the
    least loaded."""
    import numpy as np

    from tokenring.layouts import WHOLE_DOC_SHARE, local_positions

    rng = np.random.default_rng(5)
    for P in (2, 3, 4, 8):
        for _ in range(5):
            S = 2048 * P
            cu = _packing(S, rng, 300, 1.4)
            held = _held_once_in_order(S, P, "whole_docs", cu)
            b = torch.tensor(cu)
            lengths = (b[1:] - b[:-1]).double()
            mean = (lengths**2 / 2).sum() / P
            over = int(((lengths > S // P) | (lengths**2 / 2 > WHOLE_DOC_SHARE * mean)).sum())
            where = [set((torch.searchsorted(b, h, right=True) - 1).tolist()) for h in held]
            cut = sum(sum(d in w for w in where) > 1 for d in range(len(cu) - 1))
            assert cut <= over + P - 1, (P, cut, over)
            doc_of = [torch.searchsorted(b, h, right=True) - 1 for h in held]
            per_doc = [torch.bincount(d, h - b[d] + 1, minlength=len(cu) - 1) for h, d in zip(held, doc_of)]
            work = torch.stack([w.sum() for w in per_doc]).double()  # causal keys per query, summed
            largest = max(float(w.max()) for w in per_doc)  # one document's (or piece's) work on one rank
            assert work.max() <= 1.05 * work.mean() + largest, (P, work.tolist(), largest)
        one = [local_positions(S, P, r, "whole_docs", cu_seqlens=[0, S]) for r in range(P)]
        assert all(torch.equal(x, local_positions(S, P, r, "zigzag")) for r, x in enumerate(one)), P


def test_balanced_plan_holds_every_token_once_and_balances():
    """Each rank holds S/P tokens in increasing order, every token once; on a long-tailed packing the causal work
    (queries' and keys' side) of the busiest rank is within 10% of the mean, where zigzag is far off."""
    import numpy as np

    from tokenring.layouts import balanced_plan, local_positions

    rng = np.random.default_rng(3)
    for P in (2, 4, 8):
        S = 2048 * P
        cu = _packing(S, rng, 600, 1.6)
        held = _held_once_in_order(S, P, "balanced", cu)
        b = torch.tensor(cu)

        def work(pos, layout_held):
            doc = torch.searchsorted(b, pos, right=True) - 1
            return torch.stack([(pos - b[doc] + 1).sum(), (b[doc + 1] - pos).sum()])

        for layout, expect in (("balanced", lambda x: x <= 1.10), ("zigzag", lambda x: True)):
            pos = held if layout == "balanced" else [local_positions(S, P, r, "zigzag") for r in range(P)]
            w = torch.stack([work(p, layout) for p in pos]).double()
            ratio = (w.max(0).values / w.mean(0)).max().item()
            assert expect(ratio), (P, layout, ratio)
        assert balanced_plan(S, P, tuple(cu))[1] * 16 * P == S
