"""Packed sequences and sliding windows: which keys a query sees, and how a block of them is cut into tiles.
Conventions, tiles and the closed-form pair table: docs/internals.md, "Packed sequences and windows".
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from .layouts import DOCUMENT_LAYOUTS, PLANNED_LAYOUTS, layout_runs, local_positions

__all__ = [
    "Mask",
    "Tile",
    "make_mask",
    "tiles",
    "visible",
    "shard_pair",
    "pair_table",
    "PairTable",
    "shard_tiles",
    "shard_rows",
    "block_tiles",
    "whole_tiles",
    "TILE_ROWS",
]

TILE_ROWS = 512  # query rows per explicitly masked tile: bounds a tile's mask at 512 x its keys
RUN_ROWS = 64  # causal queries cut by runs of consecutive positions when runs average this many rows or more


@dataclass(frozen=True, eq=False)
class Mask:
    """Documents (``bounds``) and a window (``-1``: unbounded; ``right`` capped when causal) over ``S`` tokens."""

    S: int
    bounds: tuple[int, ...]
    left: int
    right: int
    causal: bool
    key: int = field(default=0, compare=False)

    def __post_init__(self):
        text = f"{self.S}|{self.left}|{self.right}|{self.causal}|" + ",".join(map(str, self.bounds))
        object.__setattr__(self, "key", zlib.crc32(text.encode()))

    def __hash__(self) -> int:
        return self.key

    def __eq__(self, other) -> bool:
        return isinstance(other, Mask) and (self.key, self.S, self.left, self.right, self.causal, self.bounds) == (
            other.key,
            other.S,
            other.left,
            other.right,
            other.causal,
            other.bounds,
        )

    @property
    def documents(self) -> int:
        return len(self.bounds) - 1

    def describe(self) -> str:
        w = "" if (self.left, self.right) == (-1, -1) else f", window=({self.left}, {self.right})"
        return f"{self.documents} document(s){w}"

    def reach(self, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For query positions ``qpos``: the first and one-past-last key position each may see."""
        b = torch.tensor(self.bounds, dtype=torch.int64, device=qpos.device)
        doc = torch.searchsorted(b, qpos, right=True) - 1
        lo, hi = b[doc], b[doc + 1]
        if self.left >= 0:
            lo = torch.maximum(lo, qpos - self.left)
        if self.right >= 0:
            hi = torch.minimum(hi, qpos + self.right + 1)
        return lo, hi

    def pair(self, qpos: torch.Tensor, kpos: torch.Tensor) -> tuple[slice, slice] | None:
        """Covering row ranges of the queries that see some key and the keys some query sees, or ``None``."""
        lo, hi = self.reach(qpos)
        a = torch.searchsorted(kpos, lo)
        b = torch.searchsorted(kpos, hi)
        live = (b > a).nonzero()
        if live.numel() == 0:
            return None
        r0, r1 = int(live[0]), int(live[-1]) + 1
        return slice(r0, r1), slice(int(a[r0:r1][(b > a)[r0:r1]].min()), int(b[r0:r1].max()))


def _whole(x, what: str, given) -> int:
    """``x`` as an int if it is a whole number, else ValueError (never truncated)."""
    try:
        value = int(x)
        whole = value == x
    except (TypeError, ValueError, RuntimeError):
        whole = False
    if not whole or isinstance(x, bool):
        raise ValueError(f"{what} must hold whole numbers of tokens, got {x!r} in {given!r}")
    return value


def whole_numbers(values, what: str) -> list[int]:
    """``values`` (a list, tuple or 1-D tensor) as ints, each a whole number (ValueError otherwise)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        return [_whole(x, what, values) for x in values]
    except TypeError:
        raise ValueError(f"{what} must be a sequence of whole numbers, got {values!r}") from None


def check_bounds_tensor(cu_seqlens: torch.Tensor) -> None:
    """ValueError unless ``cu_seqlens`` is a 1-D integer tensor."""
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [0, end_1, ..., S], got shape "
            f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )


def window_pair(window) -> tuple[int, int]:
    """``window`` as ``(left, right)`` whole numbers (ValueError otherwise); bounds are checked by make_mask."""
    try:
        left, right = (_whole(x, "window", window) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints, -1 for unbounded; got {window!r}") from None
    return left, right


def make_mask(S: int, cu_seqlens, window, causal: bool, force: bool = False) -> Mask | None:
    """The :class:`Mask` for these arguments, or ``None`` for plain full / causal attention (unless ``force``)."""
    bounds = (0, S)
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor):
            check_bounds_tensor(cu_seqlens)
            cu = [int(x) for x in cu_seqlens.tolist()]
        else:
            cu = [_whole(x, "cu_seqlens", cu_seqlens) for x in cu_seqlens]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != S:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the global sequence length S = {S} (local "
                f"length x ranks), got {cu[:4]}{'...' if len(cu) > 4 else ''} ending at "
                f"{cu[-1] if cu else None}; the document lengths must add up to S"
            )
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError("cu_seqlens must be non-decreasing (cumulative document lengths)")
        bounds = tuple(dict.fromkeys(cu))
    left, right = -1, -1
    if window is not None:
        left, right = window_pair(window)
        if left < -1 or right < -1:
            raise ValueError(f"window=({left}, {right}): each side must be >= 0, or -1 for unbounded")
    if causal:
        right = 0
    left = -1 if left >= S - 1 else left
    right = -1 if right >= S - 1 else right
    if len(bounds) == 2 and left == -1 and (right == -1 or causal) and not force:
        return None  # plain full or causal attention
    return Mask(S, bounds, left, right, causal)


@lru_cache(maxsize=4096)
def _layout_positions(S: int, P: int, layout: str, owner: int, bounds) -> torch.Tensor:
    return local_positions(S, P, owner, layout, cu_seqlens=bounds)


def _positions(mask: Mask, P: int, layout: str, owner: int) -> torch.Tensor:
    """Global positions of ``owner``'s shard (the document layouts place tokens by the mask's documents)."""
    return _layout_positions(mask.S, P, layout, owner, mask.bounds if layout in DOCUMENT_LAYOUTS else None)


def shard_rows(mask: Mask, P: int, layout: str, owner: int, rows: slice) -> torch.Tensor:
    """Global positions of rows ``rows`` of ``owner``'s shard."""
    return _positions(mask, P, layout, owner)[rows]


def shard_pair(mask: Mask, P: int, layout: str, q_owner: int, kv_owner: int) -> tuple[slice, slice] | None:
    """Which rows of ``q_owner``'s shard see which rows of ``kv_owner``'s (:meth:`Mask.pair`)."""
    return pair_table(mask, P, layout).get(q_owner, kv_owner)


class PairTable:
    """:meth:`Mask.pair` of two ranks' shards, for every pair or those of rank ``only``."""

    def __init__(self, only: int | None, *blocks):
        self.only = only
        self.blocks = [[x.tolist() for x in arrays] for arrays in blocks]  # full: [table]; only: [row, column]
        self._by_kv = blocks[0] if only is None else None

    def needs(self, owner: int, of: str) -> tuple[list, list, list]:
        """Per rank: whether it needs rows of ``owner``'s queries or keys (``of``), and which ``[lo, hi)``."""
        if self.only is not None:
            raise KeyError(f"this table holds rank {self.only}'s pairs only")
        if of == "q":
            live, q0, q1, _, _ = self.blocks[0]
            return live[owner], q0[owner], q1[owner]
        if not isinstance(self._by_kv, list):  # the transposed lists, made once when a relay asks
            live, _, _, k0, k1 = self._by_kv
            self._by_kv = [x.T.tolist() for x in (live, k0, k1)]
        return tuple(x[owner] for x in self._by_kv)

    def get(self, q_owner: int, kv_owner: int) -> tuple[slice, slice] | None:
        if self.only is None:
            block, i, j = self.blocks[0], q_owner, kv_owner
        elif q_owner == self.only:
            block, i, j = self.blocks[0], 0, kv_owner
        elif kv_owner == self.only:
            block, i, j = self.blocks[1], q_owner, 0
        else:
            raise KeyError(f"this table holds rank {self.only}'s pairs only, not ({q_owner}, {kv_owner})")
        live, q0, q1, k0, k1 = block
        if not live[i][j]:
            return None
        return slice(q0[i][j], q1[i][j]), slice(k0[i][j], k1[i][j])


@lru_cache(maxsize=256)
def _runs(S: int, P: int, layout: str, bounds) -> tuple[np.ndarray, ...]:
    """Every shard as runs of consecutive positions: ``(owner, first position, end position, first row)``."""
    r = np.arange(P)
    if layout in PLANNED_LAYOUTS:
        held = layout_runs(S, P, layout, bounds)
        owner = np.repeat(r, [len(x) for x in held])
        first, end = (np.asarray([run[i] for x in held for run in x], np.int64).reshape(-1) for i in (0, 1))
        size = end - first
        row0 = np.concatenate([np.cumsum(size[owner == o]) - size[owner == o] for o in r])
        return owner, first, end, row0
    if layout == "contiguous":
        s = S // P
        return r, r * s, (r + 1) * s, np.zeros(P, np.int64)
    docs = [(0, S)] if layout == "zigzag" else [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    a = np.array([d[0] for d in docs], np.int64)[None, :]
    c = (np.array([d[1] for d in docs], np.int64)[None, :] - a) // (2 * P)  # (1, docs): chunk per document
    first = np.stack([a + r[:, None] * c, a + (2 * P - 1 - r[:, None]) * c], 2).reshape(P, -1)  # (P, 2 * docs)
    size = np.broadcast_to(np.repeat(c, 2, 1), first.shape)
    row0 = np.cumsum(size, 1) - size
    owner = np.broadcast_to(r[:, None], first.shape)
    return owner.ravel(), first.ravel(), (first + size).ravel(), row0.ravel()


@lru_cache(maxsize=8)
def pair_table(mask: Mask, P: int, layout: str, only: int | None = None) -> PairTable:
    """:class:`PairTable` of ``mask`` over ``P`` shards (``only``: that rank's pairs), in closed form over runs
    of positions; why it is exact: docs/internals.md."""
    runs = _runs(mask.S, P, layout, mask.bounds if layout in DOCUMENT_LAYOUTS else None)
    if only is None:
        return PairTable(None, _pairs(mask, runs, None, None))
    return PairTable(only, _pairs(mask, runs, only, None), _pairs(mask, runs, None, only))


def _pairs(mask: Mask, runs, q_owner: int | None, kv_owner: int | None) -> tuple[np.ndarray, ...]:
    """``(live, q0, q1, k0, k1)`` arrays ``[query owner, key owner]`` of :func:`pair_table`, over every owner
    or the one given on either side."""
    owner, a, b, row0 = runs
    bounds = np.asarray(mask.bounds, np.int64)

    def doc(p):
        return np.searchsorted(bounds, p, side="right") - 1

    def side(o):  # the runs of owner o (all of them for None) and where each owner's runs start among them
        sel = slice(None) if o is None else owner == o
        own = owner[sel]
        return sel, np.flatnonzero(np.r_[True, own[1:] != own[:-1]])

    (qs, q_starts), (ks, k_starts) = side(q_owner), side(kv_owner)
    qa, qb, qrow = a[qs], b[qs], row0[qs]
    ka, kb, k_owner = a[ks], b[ks], owner[ks]
    from_pos = bounds[doc(ka)]  # the first query position that sees a key at or after a key run's start
    if mask.right >= 0:
        from_pos = np.maximum(from_pos, ka - mask.right)
    to_pos = bounds[doc(kb - 1) + 1] - 1  # the last one that sees a key before its end
    if mask.left >= 0:
        to_pos = np.minimum(to_pos, kb - 1 + mask.left)
    fp = np.maximum(qa[:, None], from_pos[None, :])  # [query run, key run]: live query positions [fp, lp]
    lp = np.minimum(qb[:, None] - 1, to_pos[None, :])
    live = fp <= lp
    big = np.iinfo(np.int64).max

    def per_owner(x, fill, reduce):
        return reduce.reduceat(reduce.reduceat(np.where(live, x, fill), q_starts, 0), k_starts, 1)

    last_pos = per_owner(lp, -1, np.maximum)
    ok = last_pos >= 0
    first_pos = np.where(ok, per_owner(fp, big, np.minimum), 0)
    last_pos = np.where(ok, last_pos, 0)
    first_row = per_owner(qrow[:, None] + fp - qa[:, None], big, np.minimum)
    last_row = per_owner(qrow[:, None] + lp - qa[:, None], -1, np.maximum)
    lo = bounds[doc(first_pos)]
    if mask.left >= 0:
        lo = np.maximum(lo, first_pos - mask.left)
    hi = bounds[doc(last_pos) + 1]
    if mask.right >= 0:
        hi = np.minimum(hi, last_pos + mask.right + 1)
    column = np.cumsum(np.r_[True, k_owner[1:] != k_owner[:-1]]) - 1  # key run -> its owner's column

    def keys_below(x):  # how many of the key owner's positions lie below x[query owner, key owner]
        return np.add.reduceat(np.clip(x[:, column] - ka[None, :], 0, (kb - ka)[None, :]), k_starts, 1)

    return ok, first_row, last_row + 1, keys_below(lo), keys_below(hi)


@lru_cache(maxsize=8192)
def shard_tiles(
    mask: Mask, P: int, layout: str, q_owner: int, q_rows: tuple[int, int], kv_owner: int, kv_rows: tuple[int, int]
) -> tuple["Tile", ...]:
    """:func:`tiles` of rows ``q_rows`` of ``q_owner``'s shard against rows ``kv_rows`` of ``kv_owner``'s."""
    qpos = _positions(mask, P, layout, q_owner)[slice(*q_rows)]
    kpos = _positions(mask, P, layout, kv_owner)[slice(*kv_rows)]
    return _tiles(mask, qpos, kpos)


def block_tiles(
    mask: Mask, P: int, layout: str, q_owner: int, q_rows: slice, kv_owner: int, kv_rows: slice, device=None
):
    """The tiles of a block of two shards' rows, and ``mask_of(tile)``: its bool mask on ``device`` or ``None``."""
    ts = shard_tiles(mask, P, layout, q_owner, (q_rows.start, q_rows.stop), kv_owner, (kv_rows.start, kv_rows.stop))
    where: dict = {}

    def mask_of(t: Tile) -> torch.Tensor | None:
        if t.kind != "mask":
            return None
        if not where:
            where["q"] = shard_rows(mask, P, layout, q_owner, q_rows).to(device)
            where["k"] = shard_rows(mask, P, layout, kv_owner, kv_rows).to(device)
        return t.mask(mask, where["q"], where["k"])

    return ts, mask_of


def whole_tiles(mask: Mask, device=None):
    """:func:`block_tiles` of the whole sequence (natural order) against itself."""
    every = slice(0, mask.S)
    return block_tiles(mask, 1, "contiguous", 0, every, 0, every, device)


def visible(mask: Mask, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """(n, m) bool: whether query position ``qpos[i]`` sees key position ``kpos[j]``."""
    lo, hi = mask.reach(qpos)
    return (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None])


@dataclass(frozen=True)
class Tile:
    """Query rows ``q0:q1`` against key rows ``k0:k1``; ``kind``: ``"full"``, ``"causal"`` or ``"mask"``."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str

    def mask(self, m: Mask, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor | None:
        return visible(m, qpos[self.q0 : self.q1], kpos[self.k0 : self.k1]) if self.kind == "mask" else None


def tiles(mask: Mask, qpos: torch.Tensor, kpos: torch.Tensor) -> list[Tile]:
    """The tiles (disjoint query rows) of queries at sorted positions ``qpos`` against keys at sorted ``kpos``."""
    return list(_tiles(mask, qpos.cpu(), kpos.cpu()))


def _tiles(mask: Mask, q: torch.Tensor, k: torch.Tensor) -> tuple[Tile, ...]:
    if not len(q) or not len(k):
        return ()
    b = torch.tensor(mask.bounds, dtype=torch.int64)
    dq = torch.searchsorted(b, q, right=True) - 1
    dk = torch.searchsorted(b, k, right=True) - 1
    out = []
    for doc in torch.unique(dq).tolist():
        qa, qb = (int(x) for x in torch.searchsorted(dq, torch.tensor([doc, doc + 1])))
        ka, kb = (int(x) for x in torch.searchsorted(dk, torch.tensor([doc, doc + 1])))
        if ka == kb:
            continue
        out += _rectangle(mask, q, k, qa, qb, ka, kb)
    return tuple(out)


def _rectangle(mask: Mask, q, k, qa, qb, ka, kb) -> list[Tile]:
    """Tiles of one document's rows: query rows ``qa:qb`` and key rows ``ka:kb`` (positions ``q``, ``k``)."""
    qmin, qmax, kmin, kmax = int(q[qa]), int(q[qb - 1]), int(k[ka]), int(k[kb - 1])
    left_ok = mask.left < 0 or kmin >= qmax - mask.left  # every query reaches back to the first key
    right_ok = mask.right < 0 or kmax <= qmin + mask.right  # and forward to the last one
    if left_ok and right_ok:
        return [Tile(qa, qb, ka, kb, "full")]
    if mask.left < 0 and mask.right == 0 and qb - qa == kb - ka and torch.equal(q[qa:qb], k[ka:kb]):
        return [Tile(qa, qb, ka, kb, "causal")]
    runs = _runs_of(q, qa, qb) if mask.left < 0 and mask.right == 0 else []
    if runs and len(runs) <= max(1, (qb - qa) // RUN_ROWS):  # causal: a run of queries sees earlier keys whole
        return [t for r0, r1 in runs for t in _causal_run(mask, q, k, r0, r1, ka, kb)]
    return _masked(mask, q, k, qa, qb, ka, kb)


def _runs_of(q: torch.Tensor, qa: int, qb: int) -> list[tuple[int, int]]:
    """Rows ``qa:qb`` of sorted positions ``q`` as runs of consecutive positions ``[(r0, r1), ...]``."""
    cuts = ((q[qa + 1 : qb] - q[qa : qb - 1]) != 1).nonzero().flatten().add(qa + 1).tolist()
    return list(zip([qa, *cuts], [*cuts, qb]))


def _causal_run(mask: "Mask", q, k, r0: int, r1: int, ka: int, kb: int) -> list["Tile"]:
    """Causal tiles of the run of queries ``r0:r1`` (one document's rows) against keys ``ka:kb``: one full tile
    of the keys before the run when none falls inside it (keys of another rank), else masked tiles."""
    before = ka + int(torch.searchsorted(k[ka:kb], q[r0]))
    inside = ka + int(torch.searchsorted(k[ka:kb], q[r1 - 1], right=True))
    if inside > before:
        return _masked(mask, q, k, r0, r1, ka, kb)
    return [Tile(r0, r1, ka, before, "full")] if before > ka else []


def _masked(mask: "Mask", q, k, qa: int, qb: int, ka: int, kb: int) -> list["Tile"]:
    """Row tiles of ``TILE_ROWS`` queries, each against the keys its rows can reach (full or masked)."""
    out = []
    for r0 in range(qa, qb, TILE_ROWS):  # row tiles, each against the keys its rows can reach
        r1 = min(qb, r0 + TILE_ROWS)
        lo, hi = mask.reach(q[r0:r1])
        a = max(ka, int(torch.searchsorted(k, lo.min())))
        b = min(kb, int(torch.searchsorted(k, hi.max())))
        if a >= b:
            continue
        full = (int(k[a]) >= int(lo.max())) and (int(k[b - 1]) < int(hi.min()))
        out.append(Tile(r0, r1, a, b, "full" if full else "mask"))
    return out
