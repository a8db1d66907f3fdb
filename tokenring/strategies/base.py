"""The strategy interface and what the schedule-driven strategies share: the store of visiting tensors and the
forward/backward ``Ops`` that give a schedule's computes and messages their meaning (docs/schedules.md).
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache
from typing import Callable

import torch

from .. import program
from ..comm import Comm
from ..executor import execute
from ..instrument import NONE as NO_HOOKS
from ..instrument import Instruments
from ..kernels import needs_equal_heads
from ..layouts import DOCUMENT_LAYOUTS
from ..masks import block_tiles
from ..merge import acc_dtype, merge_sink_, new_accumulator, sink_grad, split
from ..messages import Receive
from ..messages import kind as message_kind
from ..program import replayable
from ..schedules import (
    Compute,
    Message,
    Schedule,
    Shapes,
    all_own_pieces,
    chunk,
    covers,
    head_slice,
    overlaps,
    part_rows,
    part_slice,
    part_union,
    payload,
)
from .direct import direct
from .spec import Spec
from .tensor_ops import Merge, TensorOps, _repeat_heads, row_delta

__all__ = [
    "Strategy",
    "BlockDims",
    "Config",
    "Store",
    "ForwardOps",
    "BackwardOps",
    "Lowered",
    "ScheduledStrategy",
    "RelayOrDirect",
    "shapes_of",
    "tile_dims",
]


@dataclass(frozen=True)
class BlockDims:
    """The size of one compute, for the simulator: query rows (batch folded in), key rows, heads, copies."""

    rows_q: int
    rows_k: int
    H: int
    Hkv: int
    copies: tuple[int, ...] = ()
    tiles: tuple[tuple[int, int, str], ...] | None = None  # masked blocks: (rows_q, rows_k, kind) per kernel call


class Strategy:
    """One way to run exact attention over ranks; its members are listed in docs/schedules.md."""

    name: str = ""
    family: str = ""
    mode: str = ""
    chunks: int = 1
    lookahead: int = 1

    inner: int = 0  # ranks per node, for hierarchical strategies (0: flat, or not chosen yet)
    hierarchical: bool = False
    node_rows: bool = False  # its ring runs over whole nodes' rows: the layout over P must nest in one over nodes
    keep: bool = False  # keep the K/V that crossed nodes in forward for backward (two-level strategies)
    outer: int = 1  # sub-rounds per visiting round, K/V rows cut that many ways (two-level strategies)

    default_mode: str = ""
    PARAMS: tuple[str, ...] = ()  # the Spec fields this family takes (its constructor's keyword arguments)

    @property
    def spec(self) -> Spec:
        return Spec(self.family or self.name, self.mode, self.chunks, self.lookahead, self.inner, self.keep, self.outer)

    def make(self, spec: Spec) -> "Strategy":
        """The member of this family that ``spec`` names (for :func:`tokenring.strategies.get`)."""
        return type(self)(**{f: getattr(spec, f) for f in self.PARAMS}) if self.PARAMS else self

    @property
    def auto_spec(self) -> str:
        """The spec under which ``auto`` considers this family (a family choice where it has variants)."""
        return self.name

    def variants(self, P: int) -> list["Strategy"]:
        return [self]

    def check(self, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
        return None

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, P: int):
        return q, k, v

    def unprepare(self, dk: torch.Tensor, dv: torch.Tensor, Hkv: int):
        return dk, dv

    def saved_extra(self, saved) -> list[torch.Tensor]:
        return list(saved[4:])  # saved = (q, k, v, out, lse, ...): the first four are the op's inputs and output

    def saved_full(self, extra, q, k, v, out) -> tuple:
        return (q, k, v, out, *extra)

    def extra_like(self, q, k, v, cfg: "Config") -> list[torch.Tensor]:
        """The rows' final log-sum-exp, (B, H, s) in the accumulator dtype."""
        B, s, H, _ = q.shape
        return [q.new_empty((B, H, s), dtype=acc_dtype(q.dtype))]

    def build_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        """The schedule; ``only``: rank ``only``'s part of it where the strategy can build that alone."""
        raise NotImplementedError

    def schedule(self, P: int, layout: str, causal: bool, backward: bool, mask=None) -> Schedule:
        """The schedule, built once per ``(P, layout, causal, backward, mask)`` (treat it as read-only)."""
        return _cached_schedule(self, P, layout, causal, backward, mask)

    def rank_schedule(self, P: int, layout: str, causal: bool, backward: bool, mask, rank: int) -> Schedule:
        """What rank ``rank`` runs: the whole schedule, or with a mask the rank's part alone (``O(P)`` blocks)."""
        if mask is None:
            return self.schedule(P, layout, causal, backward)
        return _cached_rank_schedule(self, P, layout, causal, backward, mask, rank)

    def plan_schedule(self, cfg: "Config", backward: bool) -> Schedule:
        """:meth:`rank_schedule` of a call."""
        return self.rank_schedule(cfg.P, cfg.layout, cfg.causal, backward, cfg.mask, cfg.rank)

    def forward_schedule(self, P: int, layout: str, causal: bool, mask=None) -> Schedule:
        return self.schedule(P, layout, causal, False, mask)

    def backward_schedule(self, P: int, layout: str, causal: bool, mask=None) -> Schedule:
        return self.schedule(P, layout, causal, True, mask)

    def payload(self, kind: str, part: str, sh: Shapes, heads: str = "all"):
        """The tensors of one of this strategy's messages, for the simulator."""
        return payload(kind, part, sh, heads)

    def block_dims(self, c: Compute, sh: Shapes, mask=None, layout: str = "contiguous") -> BlockDims:
        """The size of compute ``c`` (with a ``mask``, also its tiles' kernel calls)."""
        h = 1 if c.heads == "all" else 2
        dims = BlockDims(sh.B * part_rows(c.q_part, sh.s), part_rows(c.kv_part, sh.s), sh.H // h, sh.Hkv // h)
        if mask is None:
            return dims
        ts, _ = block_tiles(
            mask, sh.P, layout, c.q_owner, part_slice(c.q_part, sh.s), c.kv_owner, part_slice(c.kv_part, sh.s)
        )
        return replace(dims, tiles=tile_dims(ts, sh.B))

    def forward(self, q, k, v, cfg: "Config"):
        raise NotImplementedError

    def backward(self, dout, saved, cfg: "Config"):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"


# variant parameters a cost model tries: small sets, fewer on large groups
def chunk_choices(P: int) -> tuple[int, ...]:
    return (1, 2, 4) if P <= 16 else (1, 2) if P <= 64 else (1,)


def outer_choices(m: int) -> tuple[int, ...]:
    """Sub-rounds per visiting round a cost model tries for a two-level schedule over ``m`` nodes."""
    return (1, 2, 4) if m <= 2 else (1, 2) if m <= 4 else (1,)


def lookaheads(P: int) -> list[int]:
    """Lookaheads tried for ``P`` ranks: 1, 2, 4, ... and ``P - 1`` (all at once); 1 and ``P - 1`` beyond 64."""
    if P > 64:
        return [1, P - 1]
    ks, k = [], 1
    while k < P - 1:
        ks.append(k)
        k *= 2
    return ks + [max(1, P - 1)]


@lru_cache(maxsize=256)
def _cached_schedule(strategy: Strategy, P: int, layout: str, causal: bool, backward: bool, mask) -> Schedule:
    return strategy.build_schedule(P, layout, causal, backward, mask)


@lru_cache(maxsize=64)
def _cached_rank_schedule(strategy: Strategy, P: int, layout: str, causal: bool, backward: bool, mask, rank: int):
    return strategy.build_schedule(P, layout, causal, backward, mask, rank)


def tile_dims(tiles, B: int) -> tuple[tuple[int, int, str], ...]:
    """``(rows_q, rows_k, kind)`` per kernel call of a masked block, for :attr:`BlockDims.tiles`."""
    return tuple((B * (t.q1 - t.q0), t.k1 - t.k0, t.kind) for t in tiles)


@dataclass
class Config:
    """Everything about one call except the tensors."""

    group: object
    rank: int
    P: int
    causal: bool
    layout: str
    scale: float
    hooks: Instruments = NO_HOOKS  # tests' and benchmarks' records and forced paths (tokenring.instrument)
    mask: object = None  # tokenring.masks.Mask: packed documents / sliding window, or None
    sinks: torch.Tensor | None = None  # (H,) attention-sink logits, or None

    @property
    def documents(self):
        """The documents' bounds under a layout that places tokens by document, else ``None``."""
        return self.mask.bounds if self.layout in DOCUMENT_LAYOUTS else None

    def held(self, what: str) -> list | None:
        if self.hooks.held_log is None:
            return None
        self.hooks.held_log.append((what, []))
        return self.hooks.held_log[-1][1]

    def comm(self, what: str) -> Comm:
        h = self.hooks
        c = Comm(
            self.group, h.timeout, h.trace, what, h.stage, log=h.comm_log is not None, rank=self.rank, world=self.P
        )
        if h.comm_log is not None:
            h.comm_log.append((what, c.log))
        return c


class Store:
    """Tensors held on this rank, keyed ``(kind, owner, heads)``, each a list of row pieces (docs/schedules.md)."""

    def __init__(self, sh: Shapes, me: int, expand=None):
        self.sh, self.me = sh, me
        self.expand = expand or _repeat_heads  # (tensor, g) -> its heads repeated g times
        self.entries: dict[tuple[str, int, str], list[tuple[str, str, list[torch.Tensor]]]] = {}
        # (id of a piece's tensor list, rows, heads) -> (that list, its K/V with heads repeated): see take_kv
        self.expanded: dict[tuple[int, str, str], tuple[list, list[torch.Tensor]]] = {}

    def put(self, kind: str, owner: int, part: str, tensors: list[torch.Tensor], heads: str = "all") -> None:
        """Store ``tensors`` covering rows ``part`` and ``heads`` (replacing a piece of exactly those rows)."""
        pieces = self.entries.setdefault((kind, owner, heads), [])
        pieces[:] = [p for p in pieces if p[0] != part]
        pieces.append((part, heads, tensors))
        self._prune()

    def take_kv(self, owner: int, part: str, heads: str, g: int) -> list[torch.Tensor]:
        """K and V rows ``part`` of ``owner`` with each head repeated ``g`` times, made once per stored piece."""
        if g == 1:
            return self.take("kv", owner, part, heads)
        piece = self.find("kv", owner, part, heads)
        if piece is None:
            return self.take("kv", owner, part, heads)  # raises, saying what is held instead
        key = (id(piece[2]), part, heads)
        if key not in self.expanded:
            self.expanded[key] = (
                piece[2],
                [self.expand(t, g) for t in self.take("kv", owner, part, heads)],
            )
        return self.expanded[key][1]

    def _prune(self) -> None:
        """Forget expanded K/V of pieces no longer stored (a held reference keeps an id from being reused)."""
        if self.expanded:
            live = {id(p[2]) for pieces in self.entries.values() for p in pieces}
            self.expanded = {k: v for k, v in self.expanded.items() if k[0] in live}

    def find(self, kind: str, owner: int, part: str, heads: str = "all"):
        """The piece ``(part, heads, tensors)`` that holds rows ``part`` of ``heads``, or ``None``."""
        for key in ((kind, owner, heads), (kind, owner, "all")):
            for piece in reversed(self.entries.get(key, ())):
                if covers(piece[0], part):
                    return piece
        return None

    def take(self, kind: str, owner: int, part: str, heads: str = "all") -> list[torch.Tensor]:
        """The ``part`` rows and ``heads`` of entry ``(kind, owner)``, as views."""
        piece = self.find(kind, owner, part, heads)
        if piece is None:
            held = {k: [p[0] for p in v] for k, v in self.entries.items() if k[:2] == (kind, owner)}
            raise ValueError(
                f"rank {self.me}: rows {part!r} of {kind} of rank {owner} (heads {heads}) are not "
                f"held here (held: {held}); the schedule is inconsistent"
            )
        held_part, held_heads, tensors = piece
        want, held = part_slice(part, self.sh.s), part_slice(held_part, self.sh.s)
        if want == held and held_heads == heads:  # the whole piece
            return list(tensors)
        out = []
        for t, (_, _, dim) in zip(tensors, payload(kind, held_part, self.sh, held_heads)):
            t = t.narrow(dim, want.start - held.start, want.stop - want.start)
            if held_heads != heads:  # a head half of a full-heads entry
                t = t.narrow(3 - dim, *_span(head_slice(heads, t.shape[3 - dim])))
            out.append(t)
        return out

    def release(self, step: int, reads: dict[tuple[str, int], list[tuple[int, str, int]]]) -> None:
        """Drop every piece that no read after ``step`` needs (``reads``: :meth:`Schedule.reads`)."""
        for key in [k for k in self.entries if k[1] != self.me]:
            later = [part for t, part, since in reads.get(key[:2], ()) if t > step and since <= step]
            pieces = [p for p in self.entries[key] if any(overlaps(p[0], part) for part in later)]
            if pieces:
                self.entries[key] = pieces
            else:
                del self.entries[key]
        self._prune()


def _span(sl: slice) -> tuple[int, int]:
    return sl.start, sl.stop - sl.start


def rows_heads(t, rows: slice, heads: slice, n: int, h: int, heads_dim: int = 2):
    """The view of ``t`` at ``rows`` (dim 1) and ``heads`` (dim ``heads_dim``) of its ``n`` rows and ``h`` heads
    (``t`` itself when they are all)."""
    if rows.stop - rows.start != n:
        t = t.narrow(1 if heads_dim == 2 else 2, *_span(rows))
    if heads.stop - heads.start != h:
        t = t.narrow(heads_dim, *_span(heads))
    return t


class _OpsBase(TensorOps):
    """What a schedule's computes and messages mean. The decisions (which rows, which store piece, merge or copy)
    are Python; every tensor operation goes through a method below the decisions (``attend``, ``merge_into``,
    ``add_``, ...), which :mod:`tokenring.program` records once per signature and replays."""

    def __init__(self, sh: Shapes, cfg: Config, device):
        self.sh, self.cfg, self.me, self.device = sh, cfg, cfg.rank, device
        self.store = Store(sh, cfg.rank, self.expand)

    @classmethod
    def runner(cls, sh: Shapes, cfg: Config, device) -> "_OpsBase":
        """An instance for a program's replay: the tensor operations with this call's ``cfg``, no state."""
        obj = cls.__new__(cls)
        _OpsBase.__init__(obj, sh, cfg, device)
        return obj

    def payload(self, m: Message) -> list[torch.Tensor]:
        return self.store.take(m.kind, m.owner, m.part, m.heads)  # views: Comm packs them into one buffer

    def empty(self, m: Message) -> list[torch.Tensor]:
        return self.alloc(payload(m.kind, m.part, self.sh, m.heads))

    def release(self, step: int, reads: dict) -> None:
        self.store.release(step, reads)

    def held_bytes(self) -> int:
        """Bytes held here beyond this rank's own tensors (other ranks' data, K/V with repeated heads)."""
        held = sum(
            t.numel() * t.element_size()
            for key, pieces in self.store.entries.items()
            if key[1] != self.me
            for _, _, ts in pieces
            for t in ts
        )
        return held + sum(t.numel() * t.element_size() for _, ts in self.store.expanded.values() for t in ts)

    def kv_repeat(self, q: torch.Tensor, backend: str = "auto") -> int:
        """How many times each K/V head is repeated before the kernel (1: the kernel takes grouped heads)."""
        want = self.cfg.hooks.expand_kv if self.cfg.hooks.expand_kv is not None else needs_equal_heads(q, backend)
        return self.sh.H // self.sh.Hkv if want else 1


class ForwardOps(_OpsBase):
    """Forward ops; ``keep``: owners whose arriving K/V pieces are also kept (``kept``) for the backward."""

    def __init__(self, q, k, v, sh: Shapes, cfg: Config, keep: frozenset = frozenset()):
        super().__init__(sh, cfg, q.device)
        self.keep, self.kept = keep, {}
        self.store.put("q", self.me, "all", [q])
        self.store.put("kv", self.me, "all", [k, v])
        # the accumulator: made from the first partial where that covers every row and head (adopt), else made
        # empty at the first merge (accumulated)
        self.o = self.lse = None
        self.dtype = q.dtype
        self.g = self.kv_repeat(q)
        self.seen = cfg.mask is None and q.device.type == "cpu"  # (CUDA: merge_'s one fused kernel)
        self.merged: list[tuple] = []  # (rows, heads) of every partial merged so far (with ``seen``)
        self.joined = acc_dtype(q.dtype) == q.dtype  # partials travel home as one tensor (merge.join)

    def finish(self) -> None:
        """After the last step: merge the attention sinks (``cfg.sinks``) into this rank's finished rows."""
        if self.cfg.sinks is not None:
            merge_sink_(*self.accumulated(), self.cfg.sinks)

    def accumulated(self) -> tuple:
        """This rank's accumulator ``(o, lse)`` (an empty one where no partial came)."""
        if self.o is None:
            self.o, self.lse = self.accumulator(self.dtype)
        return self.o, self.lse

    def empty(self, m: Message) -> list[torch.Tensor]:
        if m.kind == "out" and self.joined:  # one tensor: the output's shape with the lse as one more column
            (shape, dt, _), _ = payload(m.kind, m.part, self.sh, m.heads)
            return self.alloc([((*shape[:-1], shape[-1] + 1), dt)])
        return super().empty(m)

    def accumulator(self, dtype):
        sh = self.sh
        return new_accumulator(sh.B, sh.s, sh.H, sh.d, dtype, self.device)

    def _merge(self, part: str, heads: str, o, lse) -> None:
        sl, hs, sh = self.rows(part), head_slice(heads, self.sh.H), self.sh
        # no mask: every partial's rows saw a key; into untouched rows that merge gives the partial itself
        if self.o is None and self.seen and sl.stop - sl.start == sh.s and hs.stop - hs.start == sh.H:
            self.merged.append((part, heads))
            self.o, self.lse = self.adopt(o, lse, self.dtype)
            return
        acc_o, acc_lse = self.accumulated()
        acc_o, acc_lse = rows_heads(acc_o, sl, hs, sh.s, sh.H), rows_heads(acc_lse, sl, hs, sh.s, sh.H, 1)
        how = Merge.ANY if not self.seen else Merge.COPY if self._first(part, heads) else Merge.SEEN
        self.merge_into(how, acc_o, acc_lse, o, lse)

    def _first(self, part, heads: str) -> bool:
        """Whether no partial has been merged into rows ``part`` of ``heads`` yet (and note that one is)."""
        first = not any(overlaps(p, part) and (h == heads or "all" in (h, heads)) for p, h in self.merged)
        self.merged.append((part, heads))
        return first

    def compute(self, c: Compute) -> None:
        (q,) = self.store.take("q", c.q_owner, c.q_part, c.heads)
        k, v = self.store.take_kv(c.kv_owner, c.kv_part, c.heads, self.g)
        o, lse = self.attend(c, q, k, v)
        if c.q_owner == self.me:
            self._merge(c.q_part, c.heads, o, lse)
        else:
            self.store.put("out", c.q_owner, c.q_part, [self.join(o, lse)] if self.joined else [o, lse], c.heads)

    def receive(self, m: Message, tensors) -> None:
        action = message_kind(m.kind).receive
        if action == Receive.MERGE:
            self._merge(m.part, m.heads, *(split(tensors[0]) if self.joined else tensors))
        elif action == Receive.STORE:
            self.store.put(m.kind, m.owner, m.part, tensors, m.heads)
            if m.kind == "kv" and m.owner in self.keep:
                self.kept[m.owner, m.part] = tensors
        else:
            raise ValueError(f"forward cannot receive a {m.kind!r} message ({action})")

    def held_bytes(self) -> int:
        stored = {id(t) for pieces in self.store.entries.values() for _, _, ts in pieces for t in ts}
        return super().held_bytes() + sum(
            t.numel() * t.element_size() for ts in self.kept.values() for t in ts if id(t) not in stored
        )


class BackwardOps(_OpsBase):
    """``out``: this rank's final output (B, s, H, d), if kept, for the fused kernels of its own queries."""

    def __init__(self, q, k, v, dout, lse, delta, sh: Shapes, cfg: Config, out: torch.Tensor | None = None):
        super().__init__(sh, cfg, q.device)
        self.out = out
        self.store.put("qgrad", self.me, "all", [q, dout, lse, delta])
        self.store.put("kv", self.me, "all", [k, v])
        acc = acc_dtype(q.dtype)
        self.q_dtype = q.dtype  # (dQ partials go home in it)
        self.dq = self.zeros(tuple(q.shape), acc)
        self.dk = self.zeros(tuple(k.shape), acc)
        self.dv = self.zeros(tuple(k.shape), acc)
        self.g = self.kv_repeat(q, cfg.hooks.backward_kernel)

    def _add_dkv(self, owner: int, part: str, heads: str, dk, dv) -> None:
        """Add a dK/dV contribution for rows ``part`` of ``owner``'s K/V: into this rank's own, or a ``dkv`` piece."""
        if owner == self.me:
            sl, hs, sh = self.rows(part), head_slice(heads, self.sh.Hkv), self.sh
            self.add_(rows_heads(self.dk, sl, hs, sh.s, sh.Hkv), dk)
            self.add_(rows_heads(self.dv, sl, hs, sh.s, sh.Hkv), dv)
            return
        piece = self.store.find("dkv", owner, part, heads)
        if piece is None:
            old = self.store.entries.pop(("dkv", owner, heads), [])
            if not old:  # the first contribution to these rows is the accumulator itself (0 + x is x)
                acc = acc_dtype(self.sh.dtype)
                self.store.put("dkv", owner, part, [self.cast(dk, acc), self.cast(dv, acc)], heads)
                return
            whole = part
            for p in old:
                whole = part_union(whole, p[0])
            acc = [self.zeros(shape, dt) for shape, dt, _ in payload("dkv", whole, self.sh, heads)]
            self.store.put("dkv", owner, whole, acc, heads)
            for p_part, _, tensors in old:
                for a, t in zip(self.store.take("dkv", owner, p_part, heads), tensors):
                    self.add_(a, t)
        for a, t in zip(self.store.take("dkv", owner, part, heads), (dk, dv)):
            self.add_(a, t)

    def _dq_rows(self, part: str, heads: str):
        sh = self.sh
        return rows_heads(self.dq, self.rows(part), head_slice(heads, sh.H), sh.s, sh.H)

    def compute(self, c: Compute) -> None:
        q, dout, lse, delta = self.store.take("qgrad", c.q_owner, c.q_part, c.heads)
        k, v = self.store.take_kv(c.kv_owner, c.kv_part, c.heads, self.g)
        out = None
        if c.q_owner == self.me and self.out is not None:
            out = rows_heads(self.out, self.rows(c.q_part), head_slice(c.heads, self.sh.H), self.sh.s, self.sh.H)
        dq, dk, dv = self.attend_backward(c, dout, q, k, v, lse, delta, out)
        if self.g > 1:  # gradients of repeated K/V heads: sum each group back onto its K/V head
            dk, dv = self.fold_heads(dk, self.g), self.fold_heads(dv, self.g)
        if c.q_owner == self.me:
            self.add_(self._dq_rows(c.q_part, c.heads), dq)
        else:  # dQ partials go home in the input dtype, like forward partials
            self.store.put("dq", c.q_owner, c.q_part, [self.cast(dq, self.q_dtype)], c.heads)
        self._add_dkv(c.kv_owner, c.kv_part, c.heads, dk, dv)

    def receive(self, m: Message, tensors) -> None:
        action = message_kind(m.kind).receive
        if action == Receive.ADD_DQ:
            self.add_(self._dq_rows(m.part, m.heads), tensors[0])
        elif action == Receive.ADD_DKV:
            self._add_dkv(m.owner, m.part, m.heads, *tensors)
        elif action == Receive.STORE:
            self.store.put(m.kind, m.owner, m.part, tensors, m.heads)
        else:
            raise ValueError(f"backward cannot receive a {m.kind!r} message ({action})")


def shapes_of(q: torch.Tensor, k: torch.Tensor, P: int) -> Shapes:
    B, s, H, d = q.shape
    return Shapes(B, s, H, k.shape[2], d, q.dtype, P)


def _program_key(sh: Shapes, cfg: Config, device) -> tuple:
    """What a program's decisions depend on besides its schedule and comm (:func:`tokenring.program.run`)."""
    return (sh, device, cfg.mask is None, cfg.hooks.backward_kernel, cfg.hooks.expand_kv)


def _maker(cls):
    """The step loop's ``make`` for a ``build`` (:func:`tokenring.program.run`'s, which records): ``make(*args,
    cls=C)`` an instance of ``C``, by default ``cls``."""
    return lambda *args, cls=cls, **kwargs: cls(*args, **kwargs)


class Lowered(Strategy):
    """A strategy whose calls replay a program lowered once per signature (:mod:`tokenring.program`), with the
    step loop where the call's instruments need it; subclasses give ``forward``/``backward`` over :meth:`_run`."""

    def replays(self, cfg: Config) -> bool:
        """Whether a call with ``cfg`` replays its program (tracing, logs and ``step_loop`` take the loop)."""
        return replayable(cfg.hooks)

    def runner(self, cls, sh: Shapes, cfg: Config, device):
        """The ``Ops`` a replay of a ``cls`` program calls: its tensor operations, no state."""
        return cls.runner(sh, cfg, device)

    def _run(self, cls, cfg: Config, backward: bool, sh: Shapes, inputs: list, build, outputs) -> list:
        """This rank's part of the schedule over ``inputs``: ``outputs(ops)`` after running the Ops that
        ``build(make, *inputs)`` makes (``make(*args)``: a ``cls``), replayed from its program unless
        :meth:`replays` says otherwise."""
        sched = self.plan_schedule(cfg, backward)
        comm = cfg.comm(f"{self.name} {'backward' if backward else 'forward'}")
        if not self.replays(cfg):
            ops = build(_maker(cls), *inputs)
            execute(sched, comm, ops, cfg.held("backward" if backward else "forward"))
            return outputs(ops)
        runner = self.runner(cls, sh, cfg, inputs[0].device)
        key = _program_key(sh, cfg, inputs[0].device)
        return program.run(key, sched, comm, runner, inputs, lambda make, refs: build(make, *refs), outputs)

    def _replay(self, cls, cfg: Config, backward: bool, sh: Shapes, device):
        """``(program, comm, runner)`` for repeats of a call that just ran ``cls``'s program (``cfg``: no sinks,
        no instruments), holding no group (:meth:`forward_replay`); ``None`` where there is no program."""
        if cfg.sinks is not None or not self.replays(cfg):
            return None
        sched = self.plan_schedule(cfg, backward)
        comm = cfg.comm(f"{self.name} {'backward' if backward else 'forward'}")
        bare = copy(cfg)
        bare.group = comm.group = None
        runner = self.runner(cls, sh, bare, device)
        prog = program.lowered(_program_key(sh, bare, device), sched, comm, runner)
        return None if prog is None else (prog, comm, runner)

    def forward_replay(self, q, k, cfg: Config) -> Callable | None:
        """The forward of calls like this one (``q``, ``k`` prepared), whose program a call just lowered, as a
        closure ``(q, k, v, group) -> (out, extra)`` over that program, a comm and a runner: what
        :meth:`forward` works out per call, worked out once for a prepared call's repeats
        (:func:`tokenring.ops.run_ready`). It keeps no group: the caller passes the live one per call. ``None``
        where there is no program to replay."""
        return None

    def backward_replay(self, q, k, cfg: Config) -> Callable | None:
        """:meth:`forward_replay` for :meth:`backward`: ``(dout, saved, group) -> (dq, dk, dv)`` (``saved``:
        :meth:`saved_full`'s)."""
        return None


class ScheduledStrategy(Lowered):
    """A strategy run by :class:`ForwardOps` / :class:`BackwardOps`; subclasses give ``build_schedule``."""

    def kept_pieces(self, cfg: Config) -> list[tuple[int, str]]:
        """``(owner, rows)`` of the K/V pieces this rank keeps from forward for backward (none by default)."""
        return []

    def forward_replay(self, q, k, cfg: Config) -> Callable | None:
        got = self._replay(ForwardOps, cfg, False, shapes_of(q, k, cfg.P), q.device)
        if got is None:
            return None
        prog, comm, runner = got

        def run(q, k, v, group):
            o, lse, *kept = program.replay_on(prog, comm, runner, [q, k, v], group)
            return o.to(q.dtype), [lse, *kept]  # (forward()'s output and saved_extra)

        return run

    def backward_replay(self, q, k, cfg: Config) -> Callable | None:
        got = self._replay(BackwardOps, cfg, True, shapes_of(q, k, cfg.P), q.device)
        if got is None:
            return None
        prog, comm, runner = got

        def run(dout, saved, group):
            q, k, v, out, lse, *kept = saved
            inputs = [q, k, v, dout, lse, row_delta(dout, out), out, *kept]
            dq, dk, dv = program.replay_on(prog, comm, runner, inputs, group)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

        return run

    def forward(self, q, k, v, cfg: Config):
        """Returns ``out`` (B, s, H, d) and the tensors backward needs (with the kept K/V pieces, if any)."""
        pieces = self.kept_pieces(cfg)
        keep, sh = frozenset(o for o, _ in pieces), shapes_of(q, k, cfg.P)
        o, lse, *kept = self._run(
            ForwardOps, cfg, False, sh, [q, k, v],
            lambda make, q, k, v: make(q, k, v, sh, cfg, keep),
            lambda ops: [*ops.accumulated(), *(t for key in pieces for t in ops.kept[key])],
        )  # fmt: skip
        if cfg.sinks is not None:
            merge_sink_(o, lse, cfg.sinks)
        out = o.to(q.dtype)
        return out, (q, k, v, out, lse, *kept)

    def backward(self, dout, saved, cfg: Config):
        q, k, v, out, lse, *kept = saved
        delta = row_delta(dout, out)
        sh, pieces = shapes_of(q, k, cfg.P), self.kept_pieces(cfg)

        def build(make, q, k, v, dout, lse, delta, out, *kept):
            ops = make(q, k, v, dout, lse, delta, sh, cfg, out)
            for i, (owner, rows) in enumerate(pieces):
                ops.store.put("kv", owner, rows, list(kept[2 * i : 2 * i + 2]))
            return ops

        dq, dk, dv = self._run(
            BackwardOps, cfg, True, sh, [q, k, v, dout, lse, delta, out, *kept], build,
            lambda ops: [ops.dq, ops.dk, ops.dv],
        )  # fmt: skip
        dsinks = sink_grad(lse, delta, cfg.sinks) if cfg.sinks is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks

    def extra_like(self, q, k, v, cfg: Config) -> list[torch.Tensor]:
        sh = shapes_of(q, k, cfg.P)
        extra = super().extra_like(q, k, v, cfg)
        for _, rows in self.kept_pieces(cfg):
            extra += [q.new_empty(shape, dtype=dt) for shape, dt, _ in payload("kv", rows, sh)]
        return extra


class RelayOrDirect(ScheduledStrategy):
    """A family with a relay schedule and direct variants; ``mode`` is ``"relay"``, ``"direct"`` or ``"auto"``."""

    default_mode = "relay"
    mover = ""
    PARAMS = ("mode", "chunks", "lookahead")

    def __init__(self, mode: str | None = None, chunks: int = 1, lookahead: int = 1):
        mode = mode or self.default_mode
        if mode not in ("relay", "direct", "auto"):
            raise ValueError(f"{self.family} mode must be 'relay', 'direct' or 'auto', got {mode!r}")
        if mode != "direct" and (chunks, lookahead) != (1, 1):
            raise ValueError(
                f"{self.family}:{mode} moves whole blocks; chunks (c=) and lookahead (k=) apply to {self.family}:direct"
            )
        if int(chunks) < 1 or int(lookahead) < 1:
            raise ValueError(
                f"{self.family}:direct needs at least one chunk (c=) and one block of lookahead (k=), "
                f"got c={chunks}, k={lookahead}"
            )
        self.mode, self.chunks, self.lookahead = mode, int(chunks), int(lookahead)
        self.name = self.spec.text(self.default_mode)

    @property
    def auto_spec(self) -> str:
        return Spec(self.family, "auto").text(self.default_mode)

    def variants(self, P: int) -> list[Strategy]:
        if self.mode != "auto":
            return [self]
        cls = type(self)
        return [cls("relay")] + [cls("direct", c, k) for c in chunk_choices(P) for k in lookaheads(P)]

    def check(self, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
        """Why a direct variant cannot cut this rank's rows as asked (every chunk needs at least one row)."""
        if self.mode != "direct":
            return None
        if not 1 <= self.lookahead <= max(1, P - 1):
            return f"{self.name}: lookahead k must be between 1 and P-1 = {P - 1} blocks"
        if s is not None:
            rows = s // 2 if zigzag else s  # zigzag causal blocks use half of a rank's rows
            own = all_own_pieces(self.chunks, P, self.mover)  # how direct_steps cuts the own block: none empty
            if rows < self.chunks or any(part_rows(chunk("all", a, n, b), s) == 0 for a, b, n in own):
                return (
                    f"{self.name}: {self.chunks} chunks need at least {self.chunks} rows per visiting block "
                    f"and a row in each piece of the own block (the smallest: "
                    f"{min(Fraction(b - a, n) for a, b, n in own)} of its rows on {P} ranks), but this rank "
                    f"has {s}{' (halves of it)' if zigzag else ''}; use fewer chunks (c=) or a longer sequence"
                )
        return None

    def relay_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        raise NotImplementedError

    def build_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        if self.mode == "auto":
            raise ValueError(
                f"{self.name!r} is a choice among variants and has no schedule of its own: resolve "
                f"it first (tokenring.api.resolve) or name a variant, e.g. "
                f"'{self.family}:direct,c=2,k=1'"
            )
        if self.mode == "relay":
            return self.relay_schedule(P, layout, causal, backward, mask, only)
        return direct(self.name, P, layout, causal, backward, self.mover, self.chunks, self.lookahead, mask, only)
