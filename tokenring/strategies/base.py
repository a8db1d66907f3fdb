"""What ring-style strategies share: the store of visiting tensors, the forward/backward ``Ops`` that give a
schedule's computes and messages their meaning, and the autograd Function.

Forward: a compute of my queries merges into my accumulator; a compute of a visitor's queries becomes an
``out`` partial waiting to go home, and an ``out`` that arrives is merged. Backward: my dQ accumulates
locally, a visitor's dQ becomes a ``dq`` partial going home; dK/dV for my own K/V accumulate locally, those
for another rank's K/V accumulate in a ``dkv`` buffer that travels (ring) until it reaches its owner.
Pass-KV (``ring``) and pass-Q (``token_ring``) differ only in their schedules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import Comm, Trace
from ..executor import execute
from ..kernels import block_backward, block_forward
from ..merge import acc_dtype, merge_, new_accumulator
from ..schedules import Compute, Message, Schedule, Shapes, head_slice, part_slice, part_within, payload

__all__ = ["Config", "Store", "ForwardOps", "BackwardOps", "ScheduledStrategy", "ScheduledAttention"]


@dataclass
class Config:
    """Everything about one call except the tensors."""
    group: object
    rank: int
    P: int
    causal: bool
    layout: str
    scale: float
    timeout: float | None = None
    trace: Trace | None = None     # filled with timeline events when set
    comm_log: list | None = None   # receives the per-message byte records of forward and backward

    def comm(self, what: str) -> Comm:
        c = Comm(self.group, self.timeout, self.trace, what)
        if self.comm_log is not None:
            self.comm_log.append((what, c.log))
        return c


class Store:
    """Tensors held on this rank, keyed ``(kind, owner, heads)``; each entry remembers the rows and heads it
    covers, so a reader can ask for any sub-part (a rank's own inputs are stored whole)."""

    def __init__(self, sh: Shapes):
        self.sh = sh
        self.entries: dict[tuple[str, int, str], tuple[str, str, list[torch.Tensor]]] = {}

    def put(self, kind: str, owner: int, part: str, tensors: list[torch.Tensor], heads: str = "all",
            key_heads: str | None = None) -> None:
        """Store ``tensors`` covering rows ``part`` and ``heads``, under key heads ``key_heads`` (default:
        ``heads``; a travelling accumulator for one head half may be kept full-size)."""
        self.entries[(kind, owner, heads if key_heads is None else key_heads)] = (part, heads, tensors)

    def get(self, kind: str, owner: int, heads: str = "all") -> tuple[str, str, list[torch.Tensor]] | None:
        return self.entries.get((kind, owner, heads)) or self.entries.get((kind, owner, "all"))

    def take(self, kind: str, owner: int, part: str, heads: str = "all") -> list[torch.Tensor]:
        """The ``part`` rows and ``heads`` of entry ``(kind, owner)``, as views."""
        held_part, held_heads, tensors = self.get(kind, owner, heads)
        rel_rows = part_within(part, held_part)
        rel_heads = part_within(heads, held_heads)
        out = []
        for t, (_, _, dim) in zip(tensors, payload(kind, held_part, self.sh, held_heads)):
            t = t.narrow(dim, *_span(part_slice(rel_rows, t.shape[dim])))
            out.append(t.narrow(3 - dim, *_span(head_slice(rel_heads, t.shape[3 - dim]))))
        return out


def _span(sl: slice) -> tuple[int, int]:
    return sl.start, sl.stop - sl.start


class _OpsBase:
    def __init__(self, sh: Shapes, cfg: Config, device):
        self.sh, self.cfg, self.me, self.device = sh, cfg, cfg.rank, device
        self._store = Store(sh)
        self.store = self._store.entries

    def payload(self, m: Message) -> list[torch.Tensor]:
        return [t.contiguous() for t in self._store.take(m.kind, m.owner, m.part, m.heads)]

    def empty(self, m: Message) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dt, device=self.device)
                for shape, dt, _ in payload(m.kind, m.part, self.sh, m.heads)]

    def rows(self, part: str) -> slice:
        return part_slice(part, self.sh.s)


class ForwardOps(_OpsBase):
    def __init__(self, q, k, v, sh: Shapes, cfg: Config):
        super().__init__(sh, cfg, q.device)
        self._store.put("q", self.me, "all", [q])
        self._store.put("kv", self.me, "all", [k, v])
        self.o, self.lse = new_accumulator(sh.B, sh.s, sh.H, sh.d, q.dtype, q.device)

    def _merge(self, part: str, heads: str, o, lse) -> None:
        sl, hs = self.rows(part), head_slice(heads, self.sh.H)
        merge_(self.o[:, sl, hs], self.lse[:, hs, sl], o, lse)

    def compute(self, c: Compute) -> None:
        (q,) = self._store.take("q", c.q_owner, c.q_part, c.heads)
        k, v = self._store.take("kv", c.kv_owner, c.kv_part, c.heads)
        o, lse = block_forward(q, k, v, c.causal, self.cfg.scale)
        if c.q_owner == self.me:
            self._merge(c.q_part, c.heads, o, lse)
        else:
            self._store.put("out", c.q_owner, c.q_part, [o, lse], c.heads)

    def receive(self, m: Message, tensors) -> None:
        if m.kind == "out":
            self._merge(m.part, m.heads, *tensors)
        else:
            self._store.put(m.kind, m.owner, m.part, tensors, m.heads)


class BackwardOps(_OpsBase):
    def __init__(self, q, k, v, dout, lse, delta, sh: Shapes, cfg: Config):
        super().__init__(sh, cfg, q.device)
        self._store.put("qgrad", self.me, "all", [q, dout, lse, delta])
        self._store.put("kv", self.me, "all", [k, v])
        acc = acc_dtype(q.dtype)
        self.dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        self.dv = torch.zeros_like(self.dk)

    def dkv_buffer(self, owner: int, heads: str) -> list[torch.Tensor]:
        """The dK/dV accumulator for ``owner``'s K/V (head half ``heads``): this rank's own gradients, or a
        travelling one for another rank, created full-size in the accumulator dtype on first use."""
        if owner == self.me:
            return [self.dk, self.dv]
        if ("dkv", owner, heads) not in self.store:
            self._store.put("dkv", owner, "all", [torch.zeros_like(self.dk), torch.zeros_like(self.dv)],
                            key_heads=heads)
        return self.store[("dkv", owner, heads)][2]

    def _add_dkv(self, owner: int, part: str, heads: str, dk, dv) -> None:
        sl, hs = self.rows(part), head_slice(heads, self.sh.Hkv)
        acc_k, acc_v = self.dkv_buffer(owner, heads)
        acc_k[:, sl, hs] += dk
        acc_v[:, sl, hs] += dv

    def compute(self, c: Compute) -> None:
        q, dout, lse, delta = self._store.take("qgrad", c.q_owner, c.q_part, c.heads)
        k, v = self._store.take("kv", c.kv_owner, c.kv_part, c.heads)
        dq, dk, dv = block_backward(dout, q, k, v, lse, delta, c.causal, self.cfg.scale)
        if c.q_owner == self.me:
            self.dq[:, self.rows(c.q_part), head_slice(c.heads, self.sh.H)] += dq
        else:  # dQ partials go home in the input dtype, like forward partials
            self._store.put("dq", c.q_owner, c.q_part, [dq.to(q.dtype)], c.heads)
        self._add_dkv(c.kv_owner, c.kv_part, c.heads, dk, dv)

    def receive(self, m: Message, tensors) -> None:
        if m.kind == "dq":
            self.dq[:, self.rows(m.part), head_slice(m.heads, self.sh.H)] += tensors[0]
        elif m.kind == "dkv":
            self._add_dkv(m.owner, m.part, m.heads, *tensors)
        else:
            self._store.put(m.kind, m.owner, m.part, tensors, m.heads)


def shapes_of(q: torch.Tensor, k: torch.Tensor, P: int) -> Shapes:
    B, s, H, d = q.shape
    return Shapes(B, s, H, k.shape[2], d, q.dtype, P)


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` as (B, H, n) in the accumulator dtype (flash-attention's D)."""
    acc = acc_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


class ScheduledStrategy:
    """A strategy given by two schedule builders ``(P, layout, causal) -> Schedule``."""

    def __init__(self, name: str, forward_schedule: Callable[[int, str, bool], Schedule],
                 backward_schedule: Callable[[int, str, bool], Schedule]):
        self.name = name
        self.forward_schedule = forward_schedule
        self.backward_schedule = backward_schedule

    def forward(self, q, k, v, cfg: Config):
        """Returns ``out`` (B, s, H, d) and the tensors backward needs."""
        ops = ForwardOps(q, k, v, shapes_of(q, k, cfg.P), cfg)
        execute(self.forward_schedule(cfg.P, cfg.layout, cfg.causal), cfg.comm(f"{self.name} forward"), ops)
        out = ops.o.to(q.dtype)
        return out, (q, k, v, out, ops.lse)

    def backward(self, dout, saved, cfg: Config):
        q, k, v, out, lse = saved
        ops = BackwardOps(q, k, v, dout, lse, row_delta(dout, out), shapes_of(q, k, cfg.P), cfg)
        execute(self.backward_schedule(cfg.P, cfg.layout, cfg.causal), cfg.comm(f"{self.name} backward"), ops)
        return ops.dq.to(q.dtype), ops.dk.to(k.dtype), ops.dv.to(v.dtype)


class ScheduledAttention(torch.autograd.Function):
    """Autograd wrapper: ``strategy.forward`` in forward, ``strategy.backward`` in backward."""

    @staticmethod
    def forward(ctx, q, k, v, strategy, cfg: Config):
        out, saved = strategy.forward(q, k, v, cfg)
        ctx.strategy, ctx.cfg = strategy, cfg
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ctx.strategy.backward(dout.contiguous(), ctx.saved_tensors, ctx.cfg)
        return dq, dk, dv, None, None
