"""The one place that moves bytes: posts a step's messages, waits with a bounded timeout, accounts bytes and
records a trace.

Rules that keep point-to-point traffic correct on every backend (measured on gloo):
- every rank posts the same global list of messages in the same order, receives first, then sends: no
  deadlock by construction, and gloo does not serialise transfers to different peers;
- each tensor of a message gets a distinct tag (a second guard against swapped messages on gloo; NCCL
  ignores tags, the ordering rule is what makes it correct there);
- no rank ever sends to itself (gloo cannot), the schedules never produce such a message;
- every wait is bounded, so a dead or stuck peer becomes a ``RuntimeError`` naming it, never a hang.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .messages import KINDS, kind as message_kind
from .schedules import HEADS, Message

__all__ = ["Comm", "Trace", "get_timeout", "set_timeout"]

_PAIR_SLOTS = 256  # most messages one step may carry between the same two ranks (distinct tags)

_TIMEOUT_S = float(os.environ.get("TOKENRING_TIMEOUT", "300"))


def set_timeout(seconds: float) -> None:
    """Bound on any single wait for a peer (default 300 s, or ``$TOKENRING_TIMEOUT``)."""
    global _TIMEOUT_S
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, got {seconds}")
    _TIMEOUT_S = float(seconds)


def get_timeout() -> float:
    return _TIMEOUT_S


@dataclass
class Trace:
    """Timeline events (wall clock, seconds): one dict per compute block or message.

    ``lane`` is ``"compute"``, ``"send"`` or ``"recv"``; messages carry ``peer``, ``kind`` and ``bytes``.
    On CPU a message's end is when its ``wait()`` returned (gloo reports completion only there).
    """
    rank: int
    events: list[dict] = field(default_factory=list)

    def add(self, lane: str, name: str, t0: float, t1: float, **info) -> None:
        self.events.append(dict(lane=lane, name=name, start=t0, end=t1, rank=self.rank, **info))


class _Pending:
    """Posted operations of one step that are due together: ``wait()`` blocks until they are done;
    ``recvs`` are the ``(message, buffers)`` received."""

    def __init__(self, comm: "Comm", step: int, due: int, works: list, records: list[dict], recvs: list,
                 t0: float, posted: float):
        self.comm, self.step, self.due, self.works, self.records = comm, step, due, works, records
        self.recvs, self.t0, self.posted = recvs, t0, posted

    def wait(self) -> None:
        deadline = self.t0 + self.comm.timeout
        for direction, m, work, _ in self.works:
            remaining = max(0.001, deadline - time.monotonic())
            try:
                work.wait(datetime.timedelta(seconds=remaining))
            except Exception as e:  # gloo raises RuntimeError on timeout or a closed connection
                raise self.comm.failure(direction, m, self.step, e) from e
        if self.comm.trace is not None:  # one event per message, from its log record
            t1 = time.perf_counter()
            for rec in self.records:
                info = {k: v for k, v in rec.items() if k != "direction"}
                self.comm.trace.add(rec["direction"], rec["kind"], self.posted, t1, **info)


class Comm:
    """Point-to-point engine for one call on one rank of ``group``.

    ``log`` holds one record per message this rank sent or received: step, direction, peer, kind, owner,
    part and bytes; tests compare it with the byte formulas, benchmarks sum it.
    """

    def __init__(self, group=None, timeout: float | None = None, trace: Trace | None = None, what: str = ""):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = _TIMEOUT_S if timeout is None else timeout
        self.trace = trace
        self.what = what
        self.log: list[dict] = []

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def failure(self, direction: str, m: Message, step: int, err: Exception) -> RuntimeError:
        peer = m.dst if direction == "send" else m.src
        verb = "sending to" if direction == "send" else "receiving from"
        return RuntimeError(
            f"tokenring{(' ' + self.what) if self.what else ''}: rank {self.rank} failed {verb} rank {peer} "
            f"(step {step}, {m.kind} of rank {m.owner}, rows {m.part}) within {self.timeout:.0f} s: {err}. "
            f"Rank {peer} has probably died or is not calling the same attention (same shapes, strategy, "
            f"layout) - check its log. Raise the bound with tokenring.set_timeout() or $TOKENRING_TIMEOUT "
            f"if it is only slow.")

    def start(self, step: int, sends: list[tuple[Message, list[torch.Tensor]]],
              recvs: list[tuple[Message, list[torch.Tensor]]]) -> list[_Pending]:
        """Post ``recvs`` (into the given buffers) then ``sends``; returns one handle per due step (a message's
        ``due``, else this step) whose ``wait()`` blocks until those operations are done.

        All of a step's operations go into one ``batch_isend_irecv``, every receive before every send: on NCCL
        that is one group call, so ranks that all receive from one neighbour and send to another cannot
        deadlock; on gloo, sends posted before the receives of the same step serialise the transfers to
        different peers (measured: each peer's messages then wait for the previous peer's). Tags are distinct
        per (step, kind, head half, position among the step's messages between the same two ranks, tensor),
        so chunks of one kind never swap on gloo."""
        now = time.perf_counter()
        ops, meta = [], []
        groups: dict[int, tuple[list, list, list]] = {}  # due -> (operation indices, records, received)
        for direction, items in (("recv", recvs), ("send", sends)):
            fn = dist.irecv if direction == "recv" else dist.isend
            seen: dict[int, int] = {}
            for m, tensors in items:
                due = step if m.due < 0 else m.due
                idx, records, got = groups.setdefault(due, ([], [], []))
                peer = m.src if direction == "recv" else m.dst
                gpeer = self._global(peer)
                kind = message_kind(m.kind).tag * len(HEADS) + HEADS.index(m.heads)
                nth = seen[peer] = seen.get(peer, -1) + 1  # same order on both ends: the schedule's order
                nbytes = 0
                for i, t in enumerate(tensors):
                    tag = ((step * _PAIR_SLOTS + nth) * len(KINDS) * len(HEADS) + kind) * 8 + i
                    t = t.contiguous()  # kept referenced in `meta` until the wait completes
                    idx.append(len(ops))
                    ops.append(dist.P2POp(fn, t, gpeer, self.group, tag))
                    meta.append((direction, m, t))
                    nbytes += t.numel() * t.element_size()
                records.append(dict(step=step, due=due, direction=direction, peer=peer, kind=m.kind, owner=m.owner,
                                    part=m.part, heads=m.heads, bytes=nbytes))
                if direction == "recv":
                    got.append((m, tensors))
        if not ops:
            return []
        t0 = time.monotonic()
        try:
            handles = dist.batch_isend_irecv(ops)
        except Exception as e:  # a peer that is already gone can fail the posting itself
            direction, m, _ = meta[0]
            raise self.failure(direction, m, step, e) from e
        out = []
        for due in sorted(groups):
            idx, records, got = groups[due]
            self.log.extend(records)
            works = [(*meta[i][:2], handles[i], meta[i][2]) for i in idx]
            out.append(_Pending(self, step, due, works, records, got, t0, now))
        return out
