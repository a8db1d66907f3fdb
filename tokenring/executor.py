"""Runs a :class:`~tokenring.schedules.Schedule` on real tensors: the one step loop every strategy shares.

Per step: allocate receive buffers, post the step's messages (they progress in the background), run the
step's computes meanwhile, wait, hand the received payloads to the strategy's ``Ops``, and free buffers no
later step reads. What a compute or a received message *means* is the ``Ops``' business.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from .comm import Comm
from .schedules import Compute, Message, Schedule

__all__ = ["Ops", "execute"]


class Ops(Protocol):
    store: dict

    def payload(self, m: Message) -> list[torch.Tensor]: ...          # tensors to send for ``m``
    def empty(self, m: Message) -> list[torch.Tensor]: ...            # receive buffers for ``m``
    def compute(self, c: Compute) -> None: ...
    def receive(self, m: Message, tensors: list[torch.Tensor]) -> None: ...


def _last_use(sched: Schedule, plan) -> dict:
    """``(kind, owner)`` -> last step that reads it on this rank (a compute's inputs or a message's payload);
    store keys are ``(kind, owner, heads)``, and every head half of an entry lives as long as the latest."""
    last = {}
    for t, (computes, sends, _) in enumerate(plan):
        for c in computes:
            last[(sched.q_kind, c.q_owner)] = t
            last[("kv", c.kv_owner)] = t
        for m in sends:
            last[(m.kind, m.owner)] = t
    return last


def execute(sched: Schedule, comm: Comm, ops: Ops) -> None:
    me = comm.rank
    plan = sched.for_rank(me)
    last = _last_use(sched, plan)
    trace = comm.trace
    for t, (computes, sends, recvs) in enumerate(plan):
        bufs = [ops.empty(m) for m in recvs]
        pending = comm.start(t, [(m, ops.payload(m)) for m in sends], list(zip(recvs, bufs)))
        for c in computes:
            t0 = time.perf_counter()
            ops.compute(c)
            if trace is not None:
                trace.add("compute", f"Q{c.q_owner}.{c.q_part} x KV{c.kv_owner}.{c.kv_part}", t0,
                          time.perf_counter(), step=t, q_owner=c.q_owner, kv_owner=c.kv_owner,
                          causal=c.causal)
        pending.wait()
        for m, b in zip(recvs, bufs):
            ops.receive(m, b)
        # Free what no later step reads; a rank's own inputs (owner == me) live for the whole call.
        for key in [k for k in ops.store if k[1] != me and last.get(k[:2], -1) <= t]:
            del ops.store[key]
