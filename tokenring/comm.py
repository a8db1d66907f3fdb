"""The one place that moves bytes: posts a step's messages, waits for them, accounts bytes and records a trace.

Rules that keep point-to-point traffic correct on every backend:
- every rank posts the same global list of messages in the same order, receives first, then sends: no
  deadlock by construction, and gloo does not serialise transfers to different peers (on gloo a receive may
  be posted earlier, at its message's ``ready`` step: gloo matches by tag, and holds a send until the
  receiver's notice that it is ready, which must not queue behind bulk data going the other way);
- a message travels as **one** buffer: a message of several tensors (a ``qgrad`` block is Q, dO, lse and
  delta) is packed into one flat byte buffer (:func:`buffers` makes receive buffers that are views of one),
  so each message is one point-to-point operation and one tag;
- each message gets a distinct tag (a guard against swapped messages on gloo; NCCL ignores tags, the
  ordering rule is what makes it correct there);
- no rank ever sends to itself (gloo cannot), the schedules never produce such a message;
- waits: on gloo every wait is bounded, so a dead or stuck peer becomes a ``RuntimeError`` naming it, never a
  hang. On NCCL a wait only orders the current CUDA stream after the transfer (a wait with a timeout would
  block the host until the transfer is done, serialising the step loop); a dead peer is caught there by the
  process group's timeout and watchdog (``init_process_group(timeout=...)``);
- on NCCL ``batch_isend_irecv`` may return one coalesced work for the whole step; every message of the step
  then completes with it;
- gloo cannot send CUDA tensors: with CUDA tensors on a gloo group (several processes sharing one GPU, for
  debugging), messages are staged through host memory (copied out before sending, copied back after the wait).
"""

from __future__ import annotations

import datetime
import math
import time

import torch
import torch.distributed as dist

from . import device, settings
from .messages import KINDS
from .messages import kind as message_kind
from .schedules import HEADS, Message

__all__ = [
    "Comm",
    "Trace",
    "Packed",
    "buffers",
    "pack",
    "get_timeout",
    "set_timeout",
    "collective_device",
    "wait_collective",
]

_PAIR_SLOTS = 256  # most messages one step may carry between the same two ranks (distinct tags)
_ALIGN = 16  # byte alignment of each tensor in a packed buffer (any dtype's view stays aligned)

_REPORT_WAIT_S = 1.0  # how long a failed rank waits for the others' reports before naming a silent one


def set_timeout(seconds: float) -> None:
    """Bound on any single wait for a peer on gloo (default 300 s, or ``$TOKENRING_TIMEOUT``); on NCCL the
    process group's own timeout applies. Shortcut for ``tokenring.configure(timeout=seconds)``."""
    if seconds is None:
        raise ValueError("timeout must be a positive number of seconds, got None")
    settings.configure(timeout=seconds)


def get_timeout() -> float:
    return settings.get("timeout")


collective_device = device.collective_device


def wait_collective(work, group, what: str, why: str) -> None:
    """Wait for an asynchronous collective: on gloo within the timeout, else a ``RuntimeError`` "``what`` failed
    within ... s (...); ``why``"; on NCCL the process group's own timeout and watchdog apply (no host block)."""
    if device.nccl(group):
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=get_timeout()))
    except Exception as e:
        raise RuntimeError(f"{what} failed within {get_timeout():.0f} s ({e}); {why}") from e


def group_store(group):
    """The key-value store of ``group``'s rendezvous (``None`` if torch keeps none we can reach)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_process_group_store(group) if group is not None else c10d._get_default_store()
    except Exception:  # private API: without it failures are still reported, only less precisely
        return None


def publish_refusal(group, rank: int, why: str) -> None:
    """Leave this rank's reason for refusing its arguments where :func:`silent_ranks` finds it: ranks that had
    agreed on the call's shapes at an earlier call go ahead without asking, wait for this rank's messages, and
    can then say why they never came."""
    store = group_store(group)
    try:
        if store is not None:
            store.set(f"tokenring/refused/{rank}", why[:2000])
    except Exception:  # reporting only: the refusal itself is raised whatever happens here
        pass


def silent_ranks(store, me: int, first: int, wait_s: float = _REPORT_WAIT_S) -> str:
    """After this rank failed waiting for rank ``first``: follow who waits for whom through the reports failed
    ranks leave (``tokenring/stuck/<rank>`` = the rank it waited for, at its latest failure, in this or an
    earlier call: a rank that failed in the forward never reaches the backward its peers wait in) to the first
    rank that left none within ``wait_s``: the rank that died, hangs, refused its arguments
    (:func:`publish_refusal`) or stopped calling attention. A sentence naming it ('' if it cannot be told)."""
    if store is None:
        return ""
    chain, r = [me], first
    deadline = time.monotonic() + wait_s
    try:
        while r not in chain:
            key, refused = f"tokenring/stuck/{r}", f"tokenring/refused/{r}"
            if store.check([refused]) and not store.check([key]):
                return (
                    f" Rank {r} is the one that stopped: it refused its arguments to attention (at this or an "
                    f"earlier call; the ranks had agreed on these shapes before, so the others went ahead "
                    f"without it): {store.get(refused).decode()}"
                )
            while not store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not store.check([key]):
                via = f" (who waits for whom: {' -> '.join(map(str, chain + [r]))})" if len(chain) > 1 else ""
                return (
                    f" Rank {r} is the one that stopped: it reported no failure of its own within "
                    f"{wait_s:.0f} s{via}, so it has died, hangs, or is not calling attention."
                )
            chain.append(r)
            r = int(store.get(key).decode())
        return f" Every rank of {chain} is waiting for the next: a schedule deadlock (please report it)."
    except Exception:
        return ""


class Trace:
    """Timeline events (seconds): one dict per compute block or message.

    ``lane`` is ``"compute"``, ``"send"`` or ``"recv"``; messages carry ``peer``, ``kind`` and ``bytes``.
    Timestamps come from :meth:`now`: the wall clock on CPU; on a CUDA device, CUDA events recorded on the
    current stream (kernels run asynchronously, so the host clock would time their launch), turned into
    seconds on the same wall-clock axis by :meth:`resolve`. On gloo a message's end is when its ``wait()``
    returned (gloo reports completion only there); on NCCL it is when the stream reached the transfer's end.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []
        self.cuda = False
        self._ref = None  # (CUDA event, wall-clock seconds at that event)

    def use(self, where) -> None:
        """Take timestamps for work on device ``where`` (CUDA events on a CUDA device)."""
        self.cuda = device.is_cuda(where)

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        if self._ref is None:
            device.synchronize()
            ref = device.Event()
            ref.record()
            ref.synchronize()
            self._ref = (ref, time.perf_counter())
        e = device.Event()
        e.record()
        return e

    def add(self, lane: str, name: str, t0, t1, **info) -> None:
        self.events.append(dict(lane=lane, name=name, start=t0, end=t1, rank=self.rank, **info))

    def resolve(self) -> None:
        """Turn CUDA-event timestamps into seconds (synchronises the device; a no-op on CPU)."""
        if self._ref is None:
            return
        ref, wall = self._ref
        device.synchronize()
        for e in self.events:
            for key in ("start", "end"):
                if not isinstance(e[key], float):
                    e[key] = wall + ref.elapsed_time(e[key]) / 1e3


def _peer(direction: str, m: Message) -> int:
    """The other end of ``m`` for the rank that sends (``"send"``) or receives (``"recv"``) it."""
    return m.dst if direction == "send" else m.src


class Packed(list):
    """Tensors that are views of one flat byte buffer ``flat`` (what one message travels as)."""

    flat: torch.Tensor


def buffers(specs, device) -> Packed:
    """Receive buffers for a message of tensors ``specs`` (``(shape, dtype, ...)`` each): views of one flat byte
    buffer that the message is received into, each tensor starting on a ``_ALIGN``-byte boundary."""
    spans, total = [], 0
    for shape, dtype, *_ in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        spans.append((total, nbytes, dtype, shape))
        total += -(-nbytes // _ALIGN) * _ALIGN
    out = Packed()
    out.flat = torch.empty(total, dtype=torch.uint8, device=device)
    out.extend(out.flat[off : off + n].view(dtype).view(shape) for off, n, dtype, shape in spans)
    return out


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer holding ``tensors`` as :func:`buffers` lays them out (a single tensor is sent as
    it is, copied only when it is not contiguous)."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    views = buffers([(t.shape, t.dtype) for t in tensors], tensors[0].device)
    for dst, src in zip(views, tensors):
        dst.copy_(src)
    return views.flat


def _flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """The buffer to receive ``tensors`` into, and copies to make after the wait when it is not theirs."""
    if isinstance(tensors, Packed):
        return tensors.flat, []
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0], []
    into = buffers([(t.shape, t.dtype) for t in tensors], tensors[0].device)
    return into.flat, list(zip(tensors, into))


class _Once:
    """A posted operation, waited for at most once: a gloo work must not be waited for twice (a second wait
    waits for another transfer), while one coalesced NCCL work may stand for messages due at several steps."""

    def __init__(self, work):
        self.work, self.done = work, False

    def wait(self, deadline: float | None) -> None:
        if self.done:
            return
        if deadline is None:  # NCCL: orders the current stream after the transfer, does not block the host
            self.work.wait()
        else:
            self.work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        self.done = True


class _Pending:
    """Posted operations of one step that are due together: ``wait()`` blocks until they are done (on NCCL:
    orders the current stream after them); ``recvs`` are the ``(message, buffers)`` received."""

    def __init__(
        self,
        comm: "Comm",
        step: int,
        due: int,
        works: list,
        records: list[dict],
        recvs: list,
        copies: list,
        t0: float,
        posted,
    ):
        self.comm, self.step, self.due, self.works, self.records = comm, step, due, works, records
        self.recvs, self.copies, self.t0, self.posted = recvs, copies, t0, posted

    def wait(self) -> None:
        comm = self.comm
        deadline = self.t0 + comm.timeout
        for direction, m, work, _ in self.works:
            try:
                work.wait(deadline if comm.bounded else None)
            except Exception as e:  # gloo raises RuntimeError on timeout or a closed connection
                raise comm.failure(direction, m, self.step, e) from e
        for dst, src in self.copies:  # staged through host memory, or received into a packed buffer
            dst.copy_(src)
        if comm.trace is not None:  # one event per message, from its log record
            t1 = comm.trace.now()
            for rec in self.records:
                info = {k: v for k, v in rec.items() if k != "direction"}
                comm.trace.add(rec["direction"], rec["kind"], self.posted, t1, **info)


class Comm:
    """Point-to-point engine for one call on one rank of ``group``.

    ``log`` holds one record per message this rank sent or received: step, direction, peer, kind, owner,
    part and bytes (of the tensors, without the packing's alignment); tests compare it with the byte formulas,
    benchmarks sum it. ``stage``: copy device tensors through host memory (``None``: on gloo, which cannot send
    CUDA tensors; ``"always"``: CPU tensors too, which exercises the path on machines without a GPU); a
    staged message's record says ``staged=True``.
    """

    def __init__(
        self,
        group=None,
        timeout: float | None = None,
        trace: Trace | None = None,
        what: str = "",
        stage: bool | str | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.bounded = not device.nccl(group)
        # Receives may be posted before their message's step (Message.ready) only where operations between two
        # ranks are matched by tag and complete one by one: gloo. NCCL matches a pair's operations in posting
        # order (and may complete a step's batch as one work), so there every receive is posted at its
        # message's step, in the order the sender posts.
        self.early_receives = backend == "gloo"
        self.stage = backend == "gloo" if stage is None else stage
        self.timeout = settings.get("timeout") if timeout is None else timeout
        self.trace = trace
        self.what = what
        self.log: list[dict] = []

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _who_stopped(self, peer: int) -> str:
        """Publish that this rank gave up waiting for ``peer`` and name the rank at the end of the chain of
        waits (gloo only: on NCCL the process group's watchdog reports)."""
        if not self.bounded:
            return ""
        store = group_store(self.group)
        try:
            store.set(f"tokenring/stuck/{self.rank}", str(peer))
        except Exception:
            return ""
        return silent_ranks(store, self.rank, peer)

    def failure(self, direction: str, m: Message | list, step: int, err: Exception) -> RuntimeError:
        if isinstance(m, list):  # one coalesced operation for the step's messages
            what = ", ".join(f"{d} {x.kind} {'to' if d == 'send' else 'from'} rank {_peer(d, x)}" for d, x in m)
            head = f"failed one of its step-{step} messages ({what})"
            peer, who = "a peer", ""
        else:
            peer = f"rank {_peer(direction, m)}"
            verb = "sending to" if direction == "send" else "receiving from"
            head = f"failed {verb} {peer} (step {step}, {m.kind} of rank {m.owner}, rows {m.part})"
            who = self._who_stopped(_peer(direction, m))
        bound = f"within {self.timeout:.0f} s" if self.bounded else "(the process group's timeout)"
        return RuntimeError(
            f"tokenring{(' ' + self.what) if self.what else ''}: rank {self.rank} {head} {bound}: {err}.{who} "
            f"{peer[0].upper() + peer[1:]} or one it waits for has probably died or is not calling the same "
            f"attention (same shapes, strategy, layout) - check its log. Raise the bound with "
            f"tokenring.set_timeout() or $TOKENRING_TIMEOUT (gloo) / init_process_group(timeout=...) (NCCL) if "
            f"it is only slow. The process group cannot be used again after this (a timed-out connection is "
            f"closed): destroy it and start the ranks again."
        )

    def _host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` travels through host memory."""
        return self.stage == "always" or (bool(self.stage) and t.device.type != "cpu")

    def start(
        self,
        step: int,
        sends: list[tuple[Message, list[torch.Tensor], tuple[int, int]]],
        recvs: list[tuple[Message, list[torch.Tensor], tuple[int, int]]],
    ) -> list[_Pending]:
        """Post ``recvs`` (into the given buffers) then ``sends``; returns one handle per due step (a message's
        ``due``, else this step) whose ``wait()`` completes those operations. Each message comes with
        ``(step it is posted by its sender, n)`` (:meth:`Schedule.postings`): its tag, the same on both ends
        even when the receiver posts early.

        All of a step's operations go into one ``batch_isend_irecv``, every receive before every send: on NCCL
        that is one group call, so ranks that all receive from one neighbour and send to another cannot
        deadlock; on gloo, sends posted before the receives of the same step serialise the transfers to
        different peers (measured: each peer's messages then wait for the previous peer's). Tags are distinct
        per (step, kind, head half, position among the step's messages between the same two ranks), so
        chunks of one kind never swap on gloo."""
        now = self.trace.now() if self.trace is not None else None
        ops, meta = [], []
        groups: dict[int, tuple[list, list, list, list]] = {}  # due -> (op indices, records, received, copies)
        for direction, items in (("recv", recvs), ("send", sends)):
            fn = dist.irecv if direction == "recv" else dist.isend
            for m, tensors, (posted, nth) in items:
                due = posted if m.due < 0 else m.due
                idx, records, got, copies = groups.setdefault(due, ([], [], [], []))
                peer = _peer(direction, m)
                kind = message_kind(m.kind).tag * len(HEADS) + HEADS.index(m.heads)
                tag = (posted * _PAIR_SLOTS + nth) * len(KINDS) * len(HEADS) + kind
                staged = False
                if direction == "send":
                    buf = pack(tensors)
                    if self._host(buf):
                        buf, staged = buf.to("cpu", copy=True), True
                else:
                    buf, after = _flat(tensors)
                    if self._host(buf):  # land in host memory, then copy into the device buffer
                        host = torch.empty(buf.shape, dtype=buf.dtype, device="cpu")
                        copies.append((buf, host))
                        buf, staged = host, True
                    copies.extend(after)  # then out of a packed buffer that was not the caller's
                    got.append((m, tensors))
                idx.append(len(ops))  # the buffer stays referenced in `meta` until the wait completes
                ops.append(dist.P2POp(fn, buf, self._global(peer), self.group, tag))
                meta.append((direction, m, buf))
                records.append(
                    dict(
                        step=step,
                        due=due,
                        direction=direction,
                        peer=peer,
                        kind=m.kind,
                        owner=m.owner,
                        part=str(m.part),
                        heads=m.heads,
                        staged=staged,
                        device=buf.device.type,
                        bytes=sum(t.numel() * t.element_size() for t in tensors),
                    )
                )
        if not ops:
            return []
        t0 = time.monotonic()
        try:
            handles = dist.batch_isend_irecv(ops)
        except Exception as e:  # a peer that is already gone can fail the posting itself
            direction, m, _ = meta[0]
            raise self.failure(direction, m, step, e) from e
        if len(handles) != len(ops):  # NCCL: one coalesced work completes every operation of the step
            every = [(d, m) for d, m, _ in meta]
            handles = [_Once(handles[0])] * len(ops)
            meta = [(d, every, b) for d, _, b in meta]
        else:
            handles = [_Once(h) for h in handles]
        out = []
        for due in sorted(groups):
            idx, records, got, copies = groups[due]
            self.log.extend(records)
            works = [(*meta[i][:2], handles[i], meta[i][2]) for i in idx]
            out.append(_Pending(self, step, due, works, records, got, copies, t0, now))
        return out
