"""Sequence layouts: which global tokens each rank holds, plus ``shard`` / ``gather``.

- ``contiguous``: rank ``r`` holds tokens ``[r*s, (r+1)*s)``.
- ``zigzag``: the sequence is cut into ``2P`` chunks; rank ``r`` holds chunks ``r`` and ``2P-1-r`` (in that
  order), which balances causal work: every rank owns one early and one late chunk.
- ``zigzag_docs``: for packed documents (``cu_seqlens``): *each document* is cut into ``2P`` chunks and rank
  ``r`` holds chunks ``r`` and ``2P-1-r`` of every document, so causal work within every document, and so in
  total, is balanced whatever the document lengths (zigzag over the packed sequence leaves the busiest rank
  with 1.6x the mean work for 16 random documents at P=4). Every document length must be a multiple of
  ``2P``; the functions below take ``cu_seqlens`` for it.
- ``balanced``: for packed documents of any lengths: the sequence is cut into ``m`` equal chunks per rank (16
  for long sequences) and a planner deals them out so that every rank holds ``S/P`` tokens and close to the same
  causal work on the query side and on the key side (:func:`balanced_plan`). Takes ``cu_seqlens`` too.
- ``whole_docs``: for packed documents of any lengths: documents stay whole on one rank, dealt out by their
  causal work, so that two ranks sharing no document exchange nothing; only a document longer than a rank's
  share of tokens, or with more work than a rank's mean, is split, zigzag-style within it, over as many ranks as
  that takes (:func:`whole_docs_plan`). Takes ``cu_seqlens`` too.
- ``auto``: one of ``zigzag``, ``contiguous``, ``balanced`` and ``whole_docs`` per batch, the one the cost model
  predicts fastest for its documents (:func:`resolve_layout`; ``zigzag`` for one). A pure function of the
  length, the ranks, the documents and two settings, so every entry point resolves it alike. Takes
  ``cu_seqlens`` too.

Within a rank the local tokens are always in increasing global order, so a causal mask on a rank's own
Q against its own K/V is the plain lower-triangular mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import settings
from .device import collective_device, values_travel

__all__ = [
    "LAYOUTS",
    "default_layout",
    "check_layout",
    "local_positions",
    "padded_length",
    "shard_positions",
    "global_order",
    "shard",
    "gather",
    "group_info",
    "document_bounds",
    "balanced_plan",
    "DOCUMENT_LAYOUTS",
    "PLANNED_LAYOUTS",
    "whole_docs_plan",
    "layout_runs",
    "Move",
    "even_out",
    "AUTO_LAYOUT",
    "LAYOUT_CHOICES",
    "resolve_layout",
    "set_placement_chooser",
    "auto_inputs",
]

LAYOUTS = ("contiguous", "zigzag", "zigzag_docs", "balanced", "whole_docs")
DOCUMENT_LAYOUTS = ("zigzag_docs", "balanced", "whole_docs")  # which tokens a rank holds depends on the documents
PLANNED_LAYOUTS = ("balanced", "whole_docs")  # a planner places documents of any lengths (padding: one more)
AUTO_LAYOUT = "auto"  # chosen per batch by the cost model: resolve_layout
LAYOUT_CHOICES = (*LAYOUTS, AUTO_LAYOUT)


def default_layout(causal: bool) -> str:
    """``zigzag`` for causal attention (it balances the triangle's work over the ranks), else ``contiguous``."""
    return "zigzag" if causal else "contiguous"


def check_layout(layout: str, auto: bool = False) -> None:
    """A ValueError unless ``layout`` names a layout (or, with ``auto``, is ``"auto"``, resolved later)."""
    if layout not in (LAYOUT_CHOICES if auto else LAYOUTS):
        raise ValueError(f"layout={layout!r} is not supported; use one of {LAYOUT_CHOICES if auto else LAYOUTS}")


def resolve_layout(layout: str, S: int | None, P: int, cu_seqlens=None, need_documents: bool = False) -> str:
    """``layout`` itself, or for ``"auto"`` the placement of this batch: ``zigzag`` for one document, else the
    one of ``zigzag``, ``contiguous``, ``balanced`` and ``whole_docs`` that the cost model predicts fastest for
    the documents (:func:`tokenring.sim.placement.choose_layout`). ``S``: the global length (``None``: the
    documents' end). The same on every rank that passes the same arguments. Without ``cu_seqlens``: zigzag, or
    with ``need_documents`` (the public entry points) a ValueError: a batch sharded with its documents and
    gathered without them would be put back in the wrong order."""
    if layout != AUTO_LAYOUT:
        return layout
    if cu_seqlens is None:
        if need_documents:
            raise ValueError(
                "layout='auto' places tokens by the packed documents and needs cu_seqlens (the same ones at shard, "
                "attention and gather; for one document of S tokens, cu_seqlens=[0, S], or layout='zigzag')"
            )
        return "zigzag"
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens))
    S = cu[-1] if S is None and cu else S
    bounds = document_bounds(S, P, cu, "whole_docs")
    if P == 1 or len(bounds) <= 2 or S < 2 * P:
        return "zigzag"
    return _placement_chooser(S, P, bounds)


def auto_inputs() -> tuple:
    """What ``layout="auto"`` resolves by besides the batch (length, ranks, documents), as a cache key: the topology
    and layer settings, and this process's thread count (a CPU topology's kernel model reads it)."""
    spec = settings.get("topology")
    return spec if isinstance(spec, (str, type(None))) else repr(spec), settings.get("layer"), torch.get_num_threads()


def _no_chooser(S: int, P: int, bounds: tuple[int, ...]) -> str:
    raise RuntimeError("tokenring: no placement chooser registered (tokenring/__init__.py registers the cost model's)")


_placement_chooser = _no_chooser  # (S, P, bounds) -> layout: tokenring.sim.placement.choose_layout, loaded on use


def set_placement_chooser(fn) -> None:
    """Register what picks ``layout="auto"``'s placement (the cost model sits in a higher layer)."""
    global _placement_chooser
    _placement_chooser = fn


def group_info(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_divisible(S: int, P: int, layout: str, what: str = "sequence length") -> None:
    parts = _parts(S, P, layout)
    if S % parts:
        raise ValueError(
            f"{what} {S} cannot be split into equal shards for layout={layout!r} over {P} ranks: it must be "
            f"divisible by {parts} ({parts // P} chunk(s) per rank); for any length, cut it with "
            f"tokenring.shard(x, layout={layout!r}) and pass seq_len= (its length) to tokenring.attention"
        )


def document_bounds(S: int, P: int, cu_seqlens, layout: str = "zigzag_docs") -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple, checked for ``layout`` (one of :data:`DOCUMENT_LAYOUTS`): from 0 to ``S``;
    for ``zigzag_docs`` every document a multiple of ``2P`` tokens (empty ones allowed)."""
    if cu_seqlens is None:
        raise ValueError(
            f"layout={layout!r} places tokens by document and needs cu_seqlens (the packed documents' "
            f"cumulative lengths [0, end_1, ..., S]); tokenring.hf.shard_batch passes them to the layers"
        )
    cu = tuple(int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens))
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != S or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {S}; got {list(cu[:4])}...")
    if layout in PLANNED_LAYOUTS:
        return cu
    bad = [b - a for a, b in zip(cu, cu[1:]) if (b - a) % (2 * P)]
    if bad:
        raise ValueError(
            f"layout='zigzag_docs' over {P} ranks needs every document length to be a multiple of "
            f"2*P = {2 * P}; got lengths {bad[:4]}{'...' if len(bad) > 4 else ''}. Pad each document "
            f"to a multiple of {2 * P} (padding tokens in their own document), or use layout='zigzag'"
        )
    return cu


def local_positions(S: int, P: int, rank: int, layout: str, device=None, cu_seqlens=None) -> torch.Tensor:
    """Global token positions (int64, length ``S // P``) held by ``rank``, in local order (``cu_seqlens``: the
    documents, for ``zigzag_docs``)."""
    layout = resolve_layout(layout, S, P, cu_seqlens, need_documents=True)
    check_layout(layout)
    _check_divisible(S, P, layout)
    if layout in PLANNED_LAYOUTS:
        runs = layout_runs(S, P, layout, document_bounds(S, P, cu_seqlens, layout))[rank]
        return torch.cat([torch.arange(a, b, device=device) for a, b in runs] or [torch.arange(0, device=device)])
    if layout == "zigzag_docs":
        parts = []
        cu = document_bounds(S, P, cu_seqlens)
        for a, b in zip(cu, cu[1:]):
            c = (b - a) // (2 * P)
            parts += [
                torch.arange(a + rank * c, a + (rank + 1) * c, device=device),
                torch.arange(a + (2 * P - 1 - rank) * c, a + (2 * P - rank) * c, device=device),
            ]
        return torch.cat(parts)
    if layout == "contiguous":
        s = S // P
        return torch.arange(rank * s, (rank + 1) * s, device=device)
    c = S // (2 * P)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * P - 1 - rank) * c, (2 * P - rank) * c, device=device)
    return torch.cat([first, second])


BALANCE_CHUNKS = 16  # chunks per rank of the balanced layout (long sequences): the planner's granularity
BALANCE_SLACK = 0.04  # the planner stops moving chunks once every rank's work is within 4% of the mean
SWAP_TRIES = 32  # swaps (the best-balancing first) among which the planner takes the least spreading one


def balanced_plan(S: int, P: int, bounds: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The ``balanced`` layout: ``(chunks held by each rank, in increasing order; chunk size)`` for ``S`` tokens
    over ``P`` ranks with documents ``bounds``. Every rank holds as many chunks; causal work is dealt out on both
    sides at once (a query row's keys, for strategies that compute where the queries live; a key row's queries,
    for those that compute where the keys live, as TokenRing does): bench/results/balance.md measures it."""
    return _plan(S, P, tuple(bounds))


@lru_cache(maxsize=64)
def _plan(S: int, P: int, bounds: tuple[int, ...]):
    m = _parts(S, P, "balanced") // P
    c = S // (P * m)
    b = np.asarray(bounds, np.int64)
    pos = np.arange(S, dtype=np.int64)
    doc = np.searchsorted(b, pos, side="right") - 1
    work = np.stack([(pos - b[doc] + 1), (b[doc + 1] - pos)], 1).reshape(P * m, c, 2).sum(1).astype(np.float64)
    first = doc[::c]
    owner = _deal(work, P, m, np.stack([first, doc[c - 1 :: c]], 1))
    return tuple(tuple(np.flatnonzero(owner == r).tolist()) for r in range(P)), c


def _deal(work: np.ndarray, P: int, m: int, docs: np.ndarray) -> np.ndarray:
    """Owner of each chunk (``work``: its query- and key-side work; ``docs``: its first and last document). From
    the contiguous split, swaps of two chunks that lower the busiest rank's busier side, until every rank is
    within ``BALANCE_SLACK`` of the mean. Among the best few swaps, the one that spreads documents over the fewest
    new ranks: a document on more ranks means more messages and more kernel calls."""
    owner = np.repeat(np.arange(P, dtype=np.int64), m)
    load = np.stack([work[owner == r].sum(0) for r in range(P)])
    goal = (1 + BALANCE_SLACK) * load.mean(0)
    held = np.zeros((P, int(docs.max()) + 1), np.int64)  # chunks of each rank touching each document
    for x, (a, b) in enumerate(docs):
        held[owner[x], a : b + 1] += 1
    for _ in range(4 * len(work)):
        peak = (load / goal).max(1)
        if P == 1 or peak.max() <= 1:
            break
        hi = int(np.argmax(peak))
        mine, others = np.flatnonzero(owner == hi), np.flatnonzero(owner != hi)
        d = work[mine][:, None, :] - work[others][None, :, :]  # (mine, others, side): what a swap moves
        worse = np.maximum(((load[hi] - d) / goal).max(2), ((load[owner[others]][None] + d) / goal).max(2))
        best = np.argsort(worse, axis=None)[:SWAP_TRIES]
        better = [np.unravel_index(f, worse.shape) for f in best if worse.flat[f] < peak[hi] - 1e-12]
        if not better:
            break

        def spread(ij):
            return _spread(held, docs, mine[ij[0]], others[ij[1]], hi, owner[others[ij[1]]]), worse[ij]

        i, j = min(better, key=spread)
        x, y, lo = mine[i], others[j], owner[others[j]]
        owner[x], owner[y] = lo, hi
        load[hi] -= d[i, j]
        load[lo] += d[i, j]
        for z, src, dst in ((x, hi, lo), (y, lo, hi)):
            held[src, docs[z, 0] : docs[z, 1] + 1] -= 1
            held[dst, docs[z, 0] : docs[z, 1] + 1] += 1
    return owner


def _spread(held: np.ndarray, docs: np.ndarray, x: int, y: int, a: int, b: int) -> int:
    """How many (rank, document) pairs swapping chunk ``x`` (rank ``a``) with ``y`` (rank ``b``) adds."""
    lo, hi = min(docs[x, 0], docs[y, 0]), max(docs[x, 1], docs[y, 1]) + 1
    h = held[[a, b], lo:hi].copy()
    for z, src in ((x, 0), (y, 1)):
        h[src, docs[z, 0] - lo : docs[z, 1] + 1 - lo] -= 1
        h[1 - src, docs[z, 0] - lo : docs[z, 1] + 1 - lo] += 1
    return int((h > 0).sum() - (held[[a, b], lo:hi] > 0).sum())


WHOLE_DOC_SHARE = 1.0  # whole_docs splits a document whose causal work is over this share of a rank's mean


def whole_docs_plan(S: int, P: int, bounds: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The ``whole_docs`` layout: per rank, the ``[first, end)`` runs of positions it holds, in increasing order,
    ``S/P`` tokens each. Documents, longest first: one longer than ``S/P`` or with more causal work than
    ``WHOLE_DOC_SHARE`` of a rank's mean is cut into ``2k`` chunks over the ``k`` least loaded ranks (chunks ``j``
    and ``2k-1-j`` on the ``j``-th: the same work each); any other goes whole to the least loaded rank with room.
    A document no rank has room for fills the roomiest rank and then its ring neighbours (the last few short ones,
    as a rule). One document filling the batch is placed as zigzag places it (chunks ``j`` and ``2P-1-j`` on rank
    ``j``)."""
    return _whole_docs(S, P, tuple(bounds))


@lru_cache(maxsize=64)
def _whole_docs(S: int, P: int, bounds: tuple[int, ...]):
    s = S // P
    docs = sorted(((b - a, a) for a, b in zip(bounds, bounds[1:]) if b > a), reverse=True)
    mean = sum(n * n for n, _ in docs) / (2 * P)
    room, load = [s] * P, [0.0] * P
    runs: list[list[tuple[int, int]]] = [[] for _ in range(P)]

    def tri(m: int) -> float:  # causal pairs of m rows from a document's start
        return m * (m + 1) / 2

    def put(r: int, a: int, x: int, y: int, n: int) -> None:  # rows [x, y) of the document [a, a + n) to rank r
        runs[r].append((x, y))
        room[r] -= y - x
        load[r] += (tri(y - a) - tri(x - a) + tri(a + n - x) - tri(a + n - y)) / 2  # query and key side

    def fill(a: int, n: int, x: int) -> None:  # rows [x, a + n) to the roomiest rank, then its next ones
        r = max(range(P), key=lambda r: (room[r], -load[r]))
        while x < a + n:
            while not room[r]:
                r = (r + 1) % P
            y = min(a + n, x + room[r])
            put(r, a, x, y, n)
            x = y

    for n, a in docs:
        k = min(P, max(-(-n // s), int(-(-(n * n / 2) // (WHOLE_DOC_SHARE * mean)))))
        if k == 1:
            fits = [r for r in range(P) if room[r] >= n]
            if fits:
                put(min(fits, key=lambda r: (load[r], -room[r])), a, a, a + n, n)
            else:
                fill(a, n, a)
            continue
        edge = [a + n * i // (2 * k) for i in range(2 * k + 1)]
        need = [edge[j + 1] - edge[j] + edge[2 * k - j] - edge[2 * k - 1 - j] for j in range(k)]
        ranks = sorted(range(P), key=lambda r: (load[r], -room[r]))
        chosen: list[int] = []
        for j in range(k):  # the j-th chunk pair to the least loaded rank left with room for it
            r = next((r for r in ranks if r not in chosen and room[r] >= need[j]), None)
            if r is None:
                break
            chosen.append(r)
        if len(chosen) < k:
            fill(a, n, a)
            continue
        for j, r in enumerate(chosen):
            put(r, a, edge[j], edge[j + 1], n)
            put(r, a, edge[2 * k - 1 - j], edge[2 * k - j], n)
    return tuple(tuple(_merged(sorted(x for x in rs if x[1] > x[0]))) for rs in runs)


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def layout_runs(S: int, P: int, layout: str, bounds: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, the ``[first, end)`` runs of positions a planned layout (:data:`PLANNED_LAYOUTS`) gives it."""
    if layout == "whole_docs":
        return whole_docs_plan(S, P, bounds)
    chunks, c = balanced_plan(S, P, bounds)
    return tuple(tuple((x * c, (x + 1) * c) for x in held) for held in chunks)


def _parts(S: int, P: int, layout: str) -> int:
    """How many equal chunks ``layout`` cuts a sequence of ``S`` tokens into over ``P`` ranks (for ``"auto"``:
    a number every candidate's divides, so that padding to it leaves the choice as it was)."""
    if layout in ("balanced", AUTO_LAYOUT):
        return P * (BALANCE_CHUNKS if S > BALANCE_CHUNKS * P * 8 else 2)  # chunks of 8 tokens at least
    return 2 * P if layout.startswith("zigzag") else P


def padded_length(S: int, P: int, layout: str) -> int:
    """``S`` rounded up to a length ``layout`` splits evenly over ``P`` ranks (``2P`` chunks for zigzag; for
    ``"auto"``, a length every placement it chooses among splits evenly)."""
    check_layout(layout, auto=True)
    parts = _parts(S, P, layout)
    return -(-S // parts) * parts


def shard_positions(S: int, P: int, rank: int, layout: str, device=None, cu_seqlens=None) -> torch.Tensor:
    """Global positions ``rank`` holds of a sequence of any length ``S``: ``layout`` over ``S`` padded at the end
    to :func:`padded_length`, the padding left out (the last ranks, or zigzag's late chunks, hold fewer rows)."""
    layout = resolve_layout(layout, S, P, cu_seqlens, need_documents=True)
    check_layout(layout)
    if layout == "zigzag_docs" or S == padded_length(S, P, layout):
        return local_positions(S, P, rank, layout, device, cu_seqlens)
    Sp = padded_length(S, P, layout)
    cu = None if layout not in PLANNED_LAYOUTS else document_bounds(S, P, cu_seqlens, layout) + (Sp,)  # the padding
    idx = local_positions(Sp, P, rank, layout, device, cu)
    return idx[idx < S]


def global_order(S: int, P: int, layout: str, device=None, cu_seqlens=None) -> torch.Tensor:
    """Positions of the concatenation ``[rank 0's shard, rank 1's shard, ...]``: ``cat(...)[i]`` is token
    ``global_order[i]``. ``argsort`` of it reorders a concatenation back to natural order."""
    layout = resolve_layout(layout, S, P, cu_seqlens, need_documents=True)
    return torch.cat([local_positions(S, P, r, layout, device, cu_seqlens) for r in range(P)])


def shard(x_full: torch.Tensor, dim: int = 1, layout: str = "contiguous", group=None, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of ``x_full`` (identical on every rank) along ``dim``, of any length
    (:func:`shard_positions`; ``cu_seqlens``: the packed documents, for ``layout="zigzag_docs"``).

    With no process group initialised the whole tensor is returned.
    """
    rank, P = group_info(group)
    dim = dim % x_full.dim()
    layout = resolve_layout(layout, x_full.shape[dim], P, cu_seqlens, need_documents=True)
    idx = shard_positions(x_full.shape[dim], P, rank, layout, device=x_full.device, cu_seqlens=cu_seqlens)
    if layout == "contiguous":
        return x_full.narrow(dim, int(idx[0]) if len(idx) else 0, idx.numel())
    return x_full.index_select(dim, idx)


def gather(
    x_local: torch.Tensor, dim: int = 1, layout: str = "contiguous", group=None, cu_seqlens=None, seq_len=None
) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor along ``dim``, on every rank (not differentiable). The ranks'
    lengths are exchanged unless ``seq_len`` (the full length) is given."""
    rank, P = group_info(group)
    layout = resolve_layout(layout, seq_len, P, cu_seqlens, need_documents=True)
    check_layout(layout)
    if P == 1:
        return x_local
    dim = dim % x_local.dim()
    sizes = _shard_sizes(x_local.shape[dim], P, layout, group, seq_len, cu_seqlens)
    m = max(sizes)
    x = x_local.contiguous()
    if x.shape[dim] < m:  # uneven shards travel padded to the longest
        x = torch.cat([x, x.new_zeros(*x.shape[:dim], m - x.shape[dim], *x.shape[dim + 1 :])], dim)
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x, group=group)
    cat = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)
    if layout == "contiguous":
        return cat
    order = torch.cat([shard_positions(sum(sizes), P, r, layout, cat.device, cu_seqlens) for r in range(P)])
    return cat.index_select(dim, torch.argsort(order))


def _shard_sizes(n: int, P: int, layout: str, group, seq_len, cu_seqlens=None) -> list[int]:
    """Every rank's shard length: from ``seq_len``, else exchanged (one small all-gather)."""
    if seq_len is not None:
        return [len(shard_positions(int(seq_len), P, r, layout, cu_seqlens=cu_seqlens)) for r in range(P)]
    if not values_travel(group):  # PyTorch's fake process group: shapes only, even shards
        return [n] * P
    mine = torch.tensor([n], dtype=torch.int64, device=collective_device(group))
    got = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(got, mine, group=group)
    return [int(x) for x in got]


@dataclass(frozen=True)
class Move:
    """``rows`` rows that rank ``src`` sends from its row ``src_row`` on, and rank ``dst`` places at ``dst_row``."""

    src: int
    src_row: int
    dst: int
    dst_row: int
    rows: int


def even_out(rows: Sequence[int]) -> tuple[tuple[int, ...], tuple[Move, ...]]:
    """Shards of any sizes ``rows`` (rank order) made the contiguous split of their total (what
    :func:`shard_positions` gives each rank): every rank keeps its first rows up to its new count, the rows over
    it go, in rank order, to the ranks under theirs. Returns the new counts and the moves (at most one per rank
    pair); for attention with no order among its rows (not causal, no documents, no window)."""
    S, P = sum(rows), len(rows)
    target = tuple(len(shard_positions(S, P, r, "contiguous")) for r in range(P))
    over = [[r, t, n - t] for r, (n, t) in enumerate(zip(rows, target)) if n > t]  # rank, next row, rows left
    under = [[r, n, t - n] for r, (n, t) in enumerate(zip(rows, target)) if n < t]
    moves, i, j = [], 0, 0
    while i < len(over) and j < len(under):
        (src, a, left), (dst, b, need) = over[i], under[j]
        n = min(left, need)
        moves.append(Move(src, a, dst, b, n))
        over[i][1:] = a + n, left - n
        under[j][1:] = b + n, need - n
        i, j = i + (left == n), j + (need == n)
    return target, tuple(moves)
