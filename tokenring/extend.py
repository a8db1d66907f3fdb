"""Prefill of new tokens over a persistent sequence-sharded KV cache (the next turn of a chat, an agent step),
with the new tokens sharded too. Four forward schedules and ``auto``: docs/internals.md, "Extend".
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import program
from .agreement import code, exchange, refuse_at_exchange, require_same
from .comm import Comm, buffers, process_group
from .device import values_travel
from .executor import execute
from .instrument import NONE as NO_HOOKS
from .instrument import current as current_instruments
from .kernels import attention_inputs, block_forward, fold_scale, softmax_scale_of
from .layouts import group_info
from .masks import TILE_ROWS
from .merge import acc_dtype, join, merge_, merge_sink_, merge_stacked, new_accumulator, split
from .schedules import Message
from .strategies.extend import STRATEGIES, Shards, extend_bytes, schedule, sees, split_new  # noqa: F401
from .strategies.tensor_ops import Merge, merge_into

__all__ = [
    "STRATEGIES",
    "Shards",
    "RowMask",
    "RowsTensors",
    "RowsOps",
    "split_new",
    "attend_rows",
    "run_schedule",
    "extend_attention",
    "extend_bytes",
]


def check_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, who: str) -> None:
    """ValueError unless q is (B, t, H, d) and k, v are (B, n, Hkv, d) with H % Hkv == 0."""
    B, _, H, d = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != d or H % max(1, k.shape[2]):
        raise ValueError(
            f"rank {rank}: {who} takes q (B, t, H, d) and k, v (B, n, Hkv, d) with H % Hkv == 0; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


@dataclass(frozen=True)
class RowMask:
    """A window (``left``) and documents (``bounds``) on top of causal attention, over global positions;
    ``rows``: each batch row's own documents on top of those (e.g. ``(0, p, n)``: its ``p`` left pads apart)."""

    left: int = -1
    bounds: tuple[int, ...] = ()
    rows: tuple[tuple[int, ...], ...] = ()

    @property
    def plain(self) -> bool:
        return self.left < 0 and not self.bounds and not any(self.rows)

    def groups(self) -> list[tuple[list[int], "RowMask"]]:
        """The batch rows that share documents, each group with its mask (its ``rows`` folded into ``bounds``)."""
        out: dict[tuple[int, ...], list[int]] = {}
        for b, row in enumerate(self.rows):
            out.setdefault(row, []).append(b)
        return [
            (idx, RowMask(self.left, tuple(sorted({*self.bounds, *row})) if row else self.bounds))
            for row, idx in out.items()
        ]

    def visible(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        ok = kpos[None, :] <= qpos[:, None]
        if self.left >= 0:
            ok &= kpos[None, :] >= qpos[:, None] - self.left
        if self.bounds:
            edges = torch.tensor(self.bounds[1:-1], dtype=torch.int64, device=qpos.device)
            doc_q, doc_k = (torch.bucketize(p, edges, right=True) for p in (qpos, kpos))
            ok &= doc_q[:, None] == doc_k[None, :]
        return ok


class RowsTensors:
    """The tensor operations of attention to rows (:func:`attend_rows`, :class:`RowsOps`), as methods over a
    call's ``scale`` and ``device``: what :mod:`tokenring.program` records once per signature and replays."""

    def __init__(self, scale: float, device):
        self.scale, self.device = scale, device

    def block(self, q, k, v, causal: bool):
        return block_forward(q, k, v, causal, self.scale)

    def rows_accumulator(self, B: int, n: int, H: int, d: int, dtype):
        return new_accumulator(B, n, H, d, dtype, self.device)

    merge_into = staticmethod(merge_into)

    def cast(self, t, dtype):
        return t.to(dtype)

    def cat(self, dim: int, *ts):
        return torch.cat(ts, dim)

    def joined(self, B: int, n: int, H: int, d: int, dtype, filled: bool = True):
        """An accumulator of ``n`` rows as one (B, n, H, d + 1) tensor (:func:`split`); ``filled``: empty (0 and
        -inf), else left for copies to fill."""
        acc = acc_dtype(dtype)
        if not filled:
            return torch.empty(B, n, H, d + 1, dtype=acc, device=self.device)
        j = torch.full((B, n, H, d + 1), float("-inf"), dtype=acc, device=self.device)
        j.narrow(3, 0, d).zero_()
        return j

    join = staticmethod(join)  # (what travels home)

    def merged(self, *joined):
        """The merge of joined partials (in rank order: the same bits on every rank), as ``(o, lse)``."""
        return merge_stacked(*split(torch.stack(joined)))

    def alloc(self, specs) -> list[torch.Tensor]:
        return buffers(specs, self.device)


def attend_rows(q, qa: int, k, v, kpos, ka: int, kb: int, start: int, mask: RowMask, scale: float, ops=None):
    """The partial ``(out, lse)`` of new tokens ``qa..`` against one rank's rows (cached at ``kpos``, then new
    tokens ``ka..kb-1``), in the accumulator dtype; ``ops``: the tensor operations (:class:`RowsTensors`)."""
    if any(mask.rows):  # rows with documents of their own: one pass per group of rows that share them
        return _attend_groups(q, qa, k, v, kpos, ka, kb, start, mask, scale)
    ops = ops or RowsTensors(scale, q.device)
    B, tq, H, d = q.shape
    old, qb = k.shape[1] - (kb - ka), qa + tq
    if mask.plain and k.shape[1] and (kb == ka or kb - 1 <= qa):  # every query sees every row here: one block
        o, lse = ops.block(q, k, v, False)
        acc = acc_dtype(q.dtype)
        return ops.cast(o, acc), ops.cast(lse, acc)
    if not mask.plain:  # explicit masks from global positions, TILE_ROWS query rows at a time
        o, lse = ops.rows_accumulator(B, tq, H, d, q.dtype)
        qpos = torch.arange(start + qa, start + qb, device=q.device)
        newpos = torch.arange(start + ka, start + kb, device=q.device)
        allpos = torch.cat([kpos.to(q.device, torch.int64), newpos])
        for r0 in range(0, tq, TILE_ROWS):
            r1 = min(tq, r0 + TILE_ROWS)
            vis = mask.visible(qpos[r0:r1], allpos)
            cols = vis.any(0).nonzero().flatten()
            if len(cols):  # only the span of keys some row of the tile sees
                c0, c1 = int(cols[0]), int(cols[-1]) + 1
                part = block_forward(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], False, scale, mask=vis[:, c0:c1])
                merge_(o[:, r0:r1], lse[:, :, r0:r1], *part)
        return o, lse

    total: list = []  # (o, lse): a first block over every row itself, else an accumulator
    touched: list[tuple[int, int]] = []

    def add(r0: int, r1: int, c0: int, c1: int, causal: bool = False):
        """Query rows r0..r1-1 against keys c0..c1-1; every row sees a key: the shorter merge, or a copy into
        rows nothing was merged into yet."""
        part = ops.block(q.narrow(1, r0, r1 - r0), k.narrow(1, c0, c1 - c0), v.narrow(1, c0, c1 - c0), causal)
        if not total and (r0, r1) == (0, tq):  # (the copy it would be merged as)
            total.extend(ops.cast(x, acc_dtype(q.dtype)) for x in part)
        else:
            if not total:
                total.extend(ops.rows_accumulator(B, tq, H, d, q.dtype))
            how = Merge.SEEN if any(a < r1 and r0 < b for a, b in touched) else Merge.COPY
            ops.merge_into(how, total[0].narrow(1, r0, r1 - r0), total[1].narrow(2, r0, r1 - r0), *part)
        touched.append((r0, r1))

    if old:  # every cached row precedes every new token
        add(0, tq, 0, old)
    lo, hi = max(qa, ka), min(qb, kb)
    if lo < hi:  # queries among these new keys: keys ka..lo-1 in full, then the causal square lo..hi-1
        if lo > ka:
            add(lo - qa, hi - qa, old, old + lo - ka)
        add(lo - qa, hi - qa, old + lo - ka, old + hi - ka, causal=True)
    if kb > ka and qb > max(qa, kb):  # queries after every new key here
        add(max(qa, kb) - qa, tq, old, old + kb - ka)
    return tuple(total) if total else ops.rows_accumulator(B, tq, H, d, q.dtype)


def _attend_groups(q, qa: int, k, v, kpos, ka: int, kb: int, start: int, mask: RowMask, scale: float):
    """:func:`attend_rows` for a mask with per-row documents, the rows put back in order."""
    groups = mask.groups()
    if len(groups) == 1:
        return attend_rows(q, qa, k, v, kpos, ka, kb, start, groups[0][1], scale)
    o, lse = new_accumulator(*q.shape, q.dtype, q.device)
    for idx, sub in groups:
        i = torch.tensor(idx, device=q.device)
        o[i], lse[i] = attend_rows(q[i], qa, k[i], v[i], kpos, ka, kb, start, sub, scale)
    return o, lse


_HEADER = ["batch", "query heads", "key/value heads", "head dim", "dtype", "strategy", "window", "documents", "scale"]
_WHO = "tokenring extend"
_HEADER_NUMBERS = len(_HEADER) + 6  # besides ``state``: then t, n, new (2), the position range (2)


def _exchange_header(
    B, t, n, H, Hkv, d, dtype, new, strategy, mask, scale, pos_range, state, rank, P, group
) -> tuple[Shards, list] | None:
    """All ranks' shapes, agreed or a ``ValueError`` on every rank (``None`` on the fake process group)."""
    same = [B, H, Hkv, d, code(dtype), code(strategy), mask.left, code(mask.bounds), code(scale)]
    rows = exchange([*same, *map(float, state), t, n, *new, *pos_range], group, rank, P, _WHO, "the step's shapes")
    if rows is None:
        return None
    k = len(same) + len(state)
    require_same(
        rows,
        _HEADER + [f"state[{i}]" for i in range(len(state))],
        rank,
        _WHO,
        "Every rank must run the same step of the same model over caches from the same prefill",
        doing="extends",
    )
    shards = Shards(tuple(int(x[k + 1]) for x in rows), tuple((int(x[k + 2]), int(x[k + 3])) for x in rows))
    bad_t = [r for r, x in enumerate(rows) if x[k] != x[k + 3] - x[k + 2]]
    problem = f"rank(s) {bad_t} pass queries that are not their new tokens" if bad_t else shards.problem()
    if problem:
        raise ValueError(f"tokenring extend (rank {rank}): {problem}")
    return shards, [(x[k + 4], x[k + 5]) for x in rows]


class RowsOps(RowsTensors):
    """The executor's ``Ops`` for inference: what the computes and messages of an extend schedule
    (:mod:`tokenring.strategies.extend`) mean on rank ``rank``; every tensor operation goes through
    :class:`RowsTensors`' methods, so that without a window or documents (decisions from shapes alone) a
    schedule runs as a recorded program (:func:`run_schedule`)."""

    @classmethod
    def runner(cls, scale: float, device) -> "RowsOps":
        """An instance for a program's replay: the tensor operations with this call's ``scale``, no state."""
        obj = cls.__new__(cls)
        RowsTensors.__init__(obj, scale, device)
        return obj

    def __init__(self, strategy, q, k, v, kpos, shards, mask: RowMask, scale, rank: int, sinks=None):
        RowsTensors.__init__(self, scale, q.device)
        self.strategy, self.q, self.k, self.v, self.shards = strategy, q, k, v, shards
        self.mask, self.rank, self.sinks = mask, rank, sinks
        self.start = shards.start
        self.store = {("q", rank): [q], ("kv", rank): [k, v]}
        if not mask.plain:
            self.store["pos", rank] = [kpos]
        # partials as (o, lse, joined): their joined tensor where they are views of one, else None
        self.made: dict = {}  # q owner -> the partial this rank computed for it
        self.partials: dict = {}  # kv owner -> a partial of this rank's queries (its own, or come home)
        self.acc = None  # pass_kv: this rank's running output
        self.pieces: dict = {}  # ulysses: rank -> its rows of my head group (q, k, v), then of my output
        self.last: dict | None = None

    # the executor's interface
    def payload(self, m: Message) -> list[torch.Tensor]:
        if m.kind == "out":
            return [self._joined(self.made[m.owner] if m.owner != self.rank else self.partials[self.rank])]
        if m.kind == "u_qkv":
            return [self._group(x, m.dst) for x in (self.q, self.k, self.v)]
        if m.kind == "u_out":
            return [self.u_out[:, slice(*self.shards.new[m.dst])]]
        return self.store[m.kind, m.owner]

    def empty(self, m: Message) -> list[torch.Tensor]:
        B, tq, H, d = self.q.shape
        Hkv, sh, j = self.k.shape[2], self.shards, m.owner
        dt, kdt, kind = self.q.dtype, self.k.dtype, m.kind
        if kind == "out":  # (a partial travels joined)
            specs = [((B, tq, H, d + 1), acc_dtype(dt))]
        elif kind == "q":
            specs = [((B, sh.t(j), H, d), dt)]
        elif kind == "kv":
            specs = [((B, sh.rows[j], Hkv, d), kdt)] * 2
        elif kind == "pos":
            specs = [((sh.cached(j),), torch.int64)]
        elif kind == "u_qkv":
            specs = [((B, sh.t(j), H // sh.P, d), dt)] + [((B, sh.rows[j], Hkv // sh.P, d), kdt)] * 2
        elif kind == "u_out":
            specs = [((B, tq, H // sh.P, d), dt)]
        else:
            raise ValueError(f"extend cannot receive a {kind!r} message")
        return self.alloc(specs)

    def receive(self, m: Message, tensors: list[torch.Tensor]) -> None:
        if m.kind == "out":
            self.partials[m.src] = (*split(tensors[0]), tensors[0])
        elif m.kind in ("u_qkv", "u_out"):
            self.pieces[m.src] = tensors
        else:
            self.store[m.kind, m.owner] = tensors

    def compute_all(self, cs: list) -> None:
        if self.strategy == "ulysses":
            return self._ulysses()
        r = self.rank
        if len(cs) > 1 and self.mask.plain and all(c.kv_owner == r for c in cs):
            parts = self._attend_many([self.store["q", c.q_owner][0] for c in cs], [self._qa(c.q_owner) for c in cs])
        else:
            parts = [(*self._attend(self.store["q", c.q_owner][0], self._qa(c.q_owner), c.kv_owner), None) for c in cs]
        for c, part in zip(cs, parts):
            if c.q_owner != r:
                self.made[c.q_owner] = part
            elif self.strategy != "pass_kv":
                self.partials[c.kv_owner] = part
            else:
                if self.acc is None:
                    self.acc = self.rows_accumulator(*self.q.shape, self.q.dtype)
                self.merge_into(Merge.ANY, *self.acc, *part[:2])

    def release(self, step: int, reads: dict) -> None:
        """Drop other ranks' queries, rows and positions that no later step reads."""
        if self.last is None:
            self.last = {key: max(t for t, *_ in uses) for key, uses in reads.items()}
        for key in [key for key in self.store if key[1] != self.rank]:
            if self.last.get(("kv", key[1]) if key[0] == "pos" else key, -1) <= step:
                del self.store[key]

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's output and lse (``None`` for ulysses, whose sinks are already merged)."""
        if self.strategy == "ulysses":
            return torch.cat([self.pieces[j][0] for j in range(self.shards.P)], dim=2), None
        if self.acc is not None or self.strategy == "pass_kv":
            return self.acc or self.rows_accumulator(*self.q.shape, self.q.dtype)
        order = sorted(self.partials)  # rank order: the same bits wherever the partials were made
        if not order:
            return self.rows_accumulator(*self.q.shape, self.q.dtype)
        if len(order) == 1:
            o, lse, _ = self.partials[order[0]]
            return self.cast(o, acc_dtype(o.dtype)), lse
        return self.merged(*(self._joined(self.partials[j]) for j in order))

    def _joined(self, part: tuple):
        o, lse, joined = part
        return joined if joined is not None else self.join(o, lse)

    # the attention of queries to rows
    def _qa(self, j: int) -> int:
        return self.shards.new[j][0]

    def _new(self, j: int) -> tuple[int, int]:
        return self.shards.new[j]

    def _attend(self, q, qa: int, kj: int, k=None, v=None):
        """``q`` (queries ``qa..``) against rank ``kj``'s rows (held here, or ``k``, ``v`` given)."""
        if k is None:
            k, v = self.store["kv", kj]
        kpos = self.store.get(("pos", kj), [None])[0]
        if kpos is None and not self.mask.plain:  # no cached rows: no positions travelled
            kpos = torch.empty(0, dtype=torch.int64, device=self.device)
        return attend_rows(q, qa, k, v, kpos, *self._new(kj), self.start, self.mask, self.scale, self)

    def _attend_many(self, qs: list, qas: list[int]) -> list[tuple]:
        """This rank's rows attended by several ranks' queries, the cached block in one kernel call for all."""
        ka, kb = self._new(self.rank)
        old = self.k.shape[1] - (kb - ka)
        B, _, H, d = qs[0].shape
        rows = [q.shape[1] for q in qs]
        joined = self.joined(B, sum(rows), H, d, qs[0].dtype, filled=not old)
        o, lse = split(joined)
        if old:  # (a merge into the empty accumulator of rows that all see keys: their partial itself)
            part = self.block(self.cat(1, *qs), self.k.narrow(1, 0, old), self.v.narrow(1, 0, old), False)
            self.merge_into(Merge.COPY, o, lse, *part)
        out, at, after = [], 0, []
        kn, vn = self.k.narrow(1, old, kb - ka), self.v.narrow(1, old, kb - ka)
        for q, qa, n in zip(qs, qas, rows):
            part = (o.narrow(1, at, n), lse.narrow(2, at, n), joined.narrow(1, at, n))
            if kb > ka and qa >= kb:  # after every new row here: one full block for all such ranks, below
                after.append((q, at))
            elif kb > ka and qa + n > ka:  # some of these queries see new rows here, as a shard of no cached rows
                seen = attend_rows(q, qa, kn, vn, None, ka, kb, 0, self.mask, self.scale, self)
                self.merge_into(Merge.ANY, *part[:2], *seen)
            out.append(part)
            at += n
        if after:  # (a full block: every row sees a key; rows no cached block reached take it as it is)
            o2, lse2 = self.block(self.cat(1, *(q for q, _ in after)), kn, vn, False)
            how, at = Merge.SEEN if old else Merge.COPY, 0
            for a, n in _runs([(a, q.shape[1]) for q, a in after]):  # ranks side by side: one merge
                self.merge_into(how, o.narrow(1, a, n), lse.narrow(2, a, n), o2.narrow(1, at, n), lse2.narrow(2, at, n))
                at += n
        return out

    def _group(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Head group ``j`` of ``x`` (query or K/V heads), for Ulysses."""
        n = x.shape[2] // self.shards.P
        return x[:, :, j * n : (j + 1) * n].contiguous()

    def _ulysses(self) -> None:
        """Head group ``r`` of every rank's queries against every rank's rows of it, then the sinks."""
        r, sh = self.rank, self.shards
        self.pieces[r] = [self._group(x, r) for x in (self.q, self.k, self.v)]
        B, _, h, d = self.pieces[r][0].shape
        q_all = torch.empty(B, sh.T, h, d, dtype=self.q.dtype, device=self.device)
        for j in range(sh.P):
            q_all[:, slice(*sh.new[j])] = self.pieces[j][0]
        o, lse = new_accumulator(B, sh.T, h, d, self.q.dtype, self.device)
        for j in range(sh.P):
            merge_(o, lse, *self._attend(q_all, 0, j, *self.pieces[j][1:]))
        if self.sinks is not None:  # this head group's sinks, on finished rows
            merge_sink_(o, lse, self.sinks[r * h : (r + 1) * h])
        self.u_out = o.to(self.q.dtype)
        self.pieces = {r: [self.u_out[:, slice(*sh.new[r])]]}


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, length)`` spans with each run of adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for a, n in spans:
        if out and out[-1][0] + out[-1][1] == a:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((a, n))
    return out


def _program_key(q, k, v) -> tuple:
    """What an extend program's decisions depend on besides its schedule and comm."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, q.device)


def run_schedule(sched, args: tuple, group, what: str, log: list | None):
    """Run ``sched`` with ``RowsOps(*args)`` through :class:`Comm`: replayed from its recorded program
    (:mod:`tokenring.program`) where its decisions follow from shapes alone (no window or documents, not
    Ulysses, no log or instruments), else on the executor; log the bytes received and where the buffers were.
    Returns this rank's ``(out, lse)``."""
    strategy, q, k, v, kpos, shards, mask, scale, rank, sinks = args
    comm = Comm(group, what=what, log=log is not None, rank=rank, world=shards.P)  # (a record costs host time)
    if log is None and mask.plain and strategy != "ulysses" and program.replayable(current_instruments() or NO_HOOKS):
        key = _program_key(q, k, v)
        o, lse = program.run(
            key, sched, comm, RowsOps.runner(scale, q.device), [q, k, v],
            lambda make, refs: make(strategy, *refs, None, shards, mask, scale, rank),
            lambda ops: list(ops.result()),
        )  # fmt: skip
        return o, lse
    ops = RowsOps(*args)
    execute(sched, comm, ops)
    if log is not None:
        got = sum(x["bytes"] for x in comm.log if x["direction"] == "recv")
        devices = sorted({x["device"] for x in comm.log})
        log.append({"bytes": got, "strategy": sched.strategy, "devices": devices})
    return ops.result()


def _choose(shards: Shards, B, H, Hkv, d, q, rank: int, P: int, group, agree: bool) -> str:
    """``auto``: the schedule the simulator predicts fastest; with ``agree``, rank 0's choice on every rank."""
    from .sim.extend import choose

    mine = choose(shards, B, H, Hkv, d, q.dtype, q.device.type)
    if not agree or not values_travel(group):
        return mine
    rows = exchange([float(STRATEGIES.index(mine))], group, rank, P, _WHO, "the chosen schedule")
    return STRATEGIES[int(rows[0][0])]


def _check_turn(q, k, v, new, mask, positions, strategy: str, rank: int, P: int) -> None:
    """ValueError, before any rank is asked, for rows, new tokens, positions or a strategy this rank refuses."""
    check_rows(q, k, v, rank, "extend_attention")
    t, H = q.shape[1], q.shape[2]
    Hkv, n = k.shape[2], k.shape[1]
    if new[1] - new[0] != t or t > n:
        raise ValueError(
            f"rank {rank}: new={new} must be the token indices of this rank's {t} queries, stored as the last "
            f"{t} of its {n} rows"
        )
    if not mask.plain and (positions is None or positions.shape != (n - t,)):
        raise ValueError(
            f"rank {rank}: a window or documents need positions=, the global positions of this rank's "
            f"{n - t} cached rows (got {None if positions is None else tuple(positions.shape)})"
        )
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or 'auto'")
    if P > 1 and strategy == "ulysses" and (H % P or Hkv % P):
        raise ValueError(
            f"tokenring extend: ulysses splits the heads over the ranks and needs query heads ({H}) and key/value "
            f"heads ({Hkv}) divisible by P={P}; use strategy='pass_q'"
        )


def _agreed_shards(header: tuple, shards, checked: bool, rank: int, P: int, group):
    """Every rank's shards and cached position range: from the header exchange when ``checked``, else from
    ``shards=`` (and, with a window, one small exchange of the ranges)."""
    got = _exchange_header(*header, rank, P, group) if checked else None
    if got is not None:
        return got
    if shards is None:
        raise ValueError(f"rank {rank}: on PyTorch's fake process group extend_attention needs shards=")
    pos_range, mask = header[11], header[9]
    if mask.plain:
        return shards, [pos_range] * P  # not used without a window
    rows = exchange(pos_range, group, rank, P, _WHO, "the cached positions")
    return shards, [tuple(x) for x in rows] if rows is not None else [pos_range] * P  # fake group: shapes only


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    new: tuple[int, int],
    strategy: str = "auto",
    softmax_scale: float | None = None,
    window: int | None = None,
    cu_seqlens=None,
    positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    group=None,
    shards: Shards | None = None,
    state: tuple = (),
    log: list | None = None,
) -> torch.Tensor:
    """Attention of this rank's share ``q`` (B, t, H, d) of new tokens ``new = (a, b)`` over its K/V rows ``k``,
    ``v`` (B, n, Hkv, d: cached, then its new tokens), sharded over ``group``. Returns (B, t, H, d); the
    arguments in full: docs/internals.md, "Extend"."""
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: zero columns make the head dims equal (see value_dim_apart)
        return extend_attention(
            q, k, v, new=new, strategy=strategy, softmax_scale=softmax_scale, window=window, cu_seqlens=cu_seqlens,
            positions=positions, sinks=sinks, group=group, shards=shards, state=state, log=log,
        )[..., :dv]  # fmt: skip
    key = _repeat_key(q, k, v, new, strategy, softmax_scale, window, cu_seqlens, positions, sinks, group, shards,
                      state, log)  # fmt: skip
    rank, P = group_info(group)
    hit = _repeats.get(key) if key is not None and P > 1 else None
    if hit is not None and hit[1] is not None and hit[0]() is process_group(group) and current_instruments() is None:
        return hit[1](q, k, v, group)  # a later layer's repeat of a call that ran before: its program's replay
    try:
        B, t, H, d = q.shape
        Hkv, n = k.shape[2], k.shape[1]
        a, b = new
        mask = RowMask(-1 if window is None else int(window), tuple(int(x) for x in cu_seqlens) if cu_seqlens else ())
        _check_turn(q, k, v, new, mask, positions, strategy, rank, P)
        q, scale = fold_scale(q, softmax_scale_of(softmax_scale, d))
    except ValueError as e:  # ranks that check this step's header wait in that exchange: they raise too
        if P > 1 and (shards is None or state is not None):
            refuse_at_exchange(e, _HEADER_NUMBERS + len(state or ()), group, rank, P, _WHO, "the step's shapes")
        raise
    if P == 1:
        out, lse = attend_rows(q, a, k, v, positions, a, b, n - t, mask, scale)
        if sinks is not None:
            merge_sink_(out, lse, sinks)
        return out.to(q.dtype)
    pos_range = (
        (float(positions.min()), float(positions.max())) if positions is not None and len(positions) else (-1.0, -1.0)
    )
    checked = shards is None or state is not None
    header = (B, t, n, H, Hkv, d, q.dtype, new, strategy, mask, scale, pos_range, state or ())
    shards, ranges = _agreed_shards(header, shards, checked, rank, P, group)
    if strategy == "auto":
        strategy = _choose(shards, B, H, Hkv, d, q, rank, P, group, agree=checked)
    see = sees(shards, tuple(map(tuple, ranges)) if mask.left >= 0 else None, mask.left)
    sched = schedule(strategy, shards, see, not mask.plain)
    args = (strategy, q, k, v, positions, shards, mask, scale, rank, sinks)
    out, lse = run_schedule(sched, args, group, "extend", log)
    if lse is not None and sinks is not None:
        merge_sink_(out, lse, sinks)
    if key is not None and current_instruments() is None:
        _remember(key, sched, strategy, q, k, v, softmax_scale_of(softmax_scale, d), scale, rank, P, group)
    return out.to(q.dtype)


# A later layer's call (state=None: no check) by its arguments -> (a weak reference to the group it ran on, its
# replay: extend_attention worked out once), from its second call on; "seen" entries (None) after its first.
_repeats: "OrderedDict[tuple, tuple]" = OrderedDict()
_MAX_REPEATS = 64


def _repeat_key(q, k, v, new, strategy, softmax_scale, window, cu_seqlens, positions, sinks, group, shards, state,
                log) -> tuple | None:  # fmt: skip
    """What decides a call that skips the check (``state=None``, ``shards=`` given) and replays its program
    (no window, documents, positions, sinks, log; not ulysses), as a key; ``None`` for any other call."""
    if state is not None or shards is None or log is not None or strategy == "ulysses" or window is not None:
        return None
    if cu_seqlens or positions is not None or sinks is not None or torch.compiler.is_compiling():
        return None
    try:
        return (
            "" if group is None else group.group_name, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, tuple(int(x) for x in new), strategy, softmax_scale, shards,
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        )  # fmt: skip
    except (TypeError, AttributeError, ValueError):
        return None


def _remember(key, sched, strategy: str, q, k, v, asked: float, scale: float, rank: int, P: int, group) -> None:
    """After a call of ``key`` ran the long way: its replay, made at its second such call (``asked``: the scale
    before folding, ``scale`` after; ``q`` folded)."""
    if key not in _repeats:
        _repeats[key] = (None, None)
        if len(_repeats) > _MAX_REPEATS:
            _repeats.popitem(last=False)
        return
    comm = Comm(group, what="extend", log=False, rank=rank, world=P)
    runner = RowsOps.runner(scale, q.device)
    prog = program.lowered(_program_key(q, k, v), sched, comm, runner)
    comm.group = None  # (program.replay_on sets it per call)
    if prog is None:
        return

    def run(q, k, v, group):
        if asked <= 0:  # (fold_scale)
            q = q * asked
        o, _ = program.replay_on(prog, comm, runner, [q, k, v], group)
        return o.to(q.dtype)

    _repeats[key] = (weakref.ref(process_group(group)), run)
    _repeats.move_to_end(key)
