"""Runs a :class:`~tokenring.schedules.Schedule` on real tensors: the one step loop every strategy shares.

Per step: allocate receive buffers, post the step's messages (they progress in the background), run the
step's computes meanwhile, wait for the messages due at this step (posted now or earlier: a message may be
given until a later step, so a prefetch does not hold up the steps in between), hand the received payloads to
the strategy's ``Ops``, and free what no later step reads. What a compute or a received message *means* is
the ``Ops``' business. A receive is posted at its message's ``ready`` step where the backend allows it
(:attr:`Comm.early_receives`, gloo), else with the message.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import torch

from .comm import Comm
from .schedules import Compute, Message, Schedule

__all__ = ["Ops", "execute"]


class Ops(Protocol):
    def payload(self, m: Message) -> list[torch.Tensor]: ...  # tensors to send for ``m``
    def empty(self, m: Message) -> list[torch.Tensor]: ...  # receive buffers for ``m``
    def compute(self, c: Compute) -> None: ...  # (or ``compute_all(cs)``: a step's computes in one go)
    def receive(self, m: Message, tensors: list[torch.Tensor]) -> None: ...
    def release(self, step: int, reads: dict) -> None: ...  # free what no later step reads


@lru_cache(maxsize=512)
def _rank_plan(sched: Schedule, rank: int, early: bool):
    """This rank's per-step (computes, sends, receives to post) and every read of a stored entry."""
    return sched.postings(rank, early), sched.reads(rank)


def _compute(ops: Ops, together, computes: list[Compute], trace, t: int) -> None:
    """The step's computes, one by one or, where the ``Ops`` batch them (``together``: its ``compute_all``),
    in one call."""
    if trace is None:
        if together is not None:
            return together(computes)
        for c in computes:
            ops.compute(c)
        return
    for run in [computes] if together is not None else [[c] for c in computes]:
        t0 = trace.now()
        together(run) if together is not None else ops.compute(run[0])
        for c in run:
            trace.add(
                "compute",
                f"Q{c.q_owner}.{c.q_part} x KV{c.kv_owner}.{c.kv_part}",
                t0,
                trace.now(),
                step=t,
                q_owner=c.q_owner,
                kv_owner=c.kv_owner,
                diag=c.diag,
            )


def execute(sched: Schedule, comm: Comm, ops: Ops, held: list | None = None) -> None:
    """Run this rank's part of ``sched``. ``held``, if given, receives per step the bytes of visiting data this
    rank holds after the step (stored pieces of other ranks plus receive buffers in flight): the memory a
    schedule costs beyond a rank's own tensors."""
    plan, reads = _rank_plan(sched, comm.rank, comm.early_receives)
    trace = comm.trace
    if trace is not None:
        trace.use(getattr(ops, "device", "cpu"))
    inflight: dict[int, list] = {}  # due step -> posted operations to complete at its end
    together = getattr(ops, "compute_all", None)
    for t, (computes, sends, recvs) in enumerate(plan):
        for pending in comm.start(
            t, [(m, ops.payload(m), at) for m, *at in sends], [(m, ops.empty(m), at) for m, *at in recvs]
        ):
            inflight.setdefault(pending.due, []).append(pending)
        if computes:
            _compute(ops, together, computes, trace, t)
        for pending in inflight.pop(t, []):
            pending.wait()
            for m, bufs in pending.recvs:
                ops.receive(m, bufs)
        ops.release(t, reads)
        if held is not None:  # receive buffers in flight, and copies made for sends in flight (not views)
            flying = sum(
                b.numel() * b.element_size()
                for ps in inflight.values()
                for p in ps
                for _, bufs in p.recvs
                for b in bufs
            )
            flying += sum(
                w[3].numel() * w[3].element_size()
                for ps in inflight.values()
                for p in ps
                for w in p.works
                if w[0] == "send" and w[3]._base is None
            )
            held.append(getattr(ops, "held_bytes", lambda: 0)() + flying)
    if trace is not None:
        trace.resolve()
    if inflight:
        raise RuntimeError(
            f"schedule {sched.strategy}: messages due after its last step {len(plan) - 1}: {sorted(inflight)}"
        )
