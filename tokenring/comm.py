"""The one place that moves bytes: posts a step's messages, waits for them, accounts bytes and records a trace.
The rules that keep point-to-point traffic correct on gloo and NCCL: docs/internals.md, "Communication".
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import socket
import time
from enum import Enum
from functools import lru_cache
from multiprocessing.util import Finalize

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
    "Posting",
    "get_timeout",
    "set_timeout",
    "collective_device",
    "wait_collective",
    "guard_exit",
    "move_rows",
]

_PAIR_SLOTS = 256  # most messages one step may carry between the same two ranks (distinct tags)
_ALIGN = 16  # byte alignment of each tensor in a packed buffer (any dtype's view stays aligned)

_REPORT_WAIT_S = 1.0  # how long a failed rank waits for the others' reports before naming a silent one
_EXIT_GRACE_S = 0.1  # without /proc: how long the interpreter lets gloo's workers finish before it finalizes
_LINGER_S = 10.0  # most a failed rank's process stays up at exit while the others still read the evidence
_exit_guarded = False
_readers: dict = {}  # store key -> (store, ranks expected to read), for the wait at exit


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


def guard_exit(group) -> None:
    """Once per process, for a gloo group: at interpreter exit, wait (the GIL released) until gloo's worker
    threads are idle before Python finalizes. A gloo worker releases a finished collective's tensors after the
    caller has its result; when that drops the last reference to a tensor Python made, it needs the GIL, and if
    the interpreter is finalizing by then the thread exits inside a destructor: the process aborts (SIGABRT,
    "terminate called without an active exception") after the script has finished. A plain PyTorch script that
    ends right after a gloo all_reduce aborts so in about a third of its runs here (``bench/results/gloo_exit.md``
    for the rates with and without this, on an idle and on a loaded machine)."""
    global _exit_guarded
    if _exit_guarded:
        return
    try:  # (get_backend says "undefined" for a group made without naming its backend: the device map tells)
        gloo = "gloo" in f"{dist.get_backend(group)} {dist.get_backend_config(group)}"
    except Exception:  # not initialised, or not a group of this process
        return
    if gloo:
        _exit_guarded = True
        atexit.register(_gloo_idle)


def _gloo_idle(poll_s: float = 0.01, most_s: float = 2.0) -> None:
    """Sleep until no gloo worker thread (``pt_gloo*``) is runnable at two polls in a row, or ``most_s``; where
    threads cannot be read (no /proc), ``_EXIT_GRACE_S``. A worker waiting for the GIL is woken when this thread
    sleeps, so two quiet polls mean none is left holding a tensor."""
    deadline, quiet = time.monotonic() + most_s, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(poll_s)
        busy = _gloo_busy()
        if busy is None:
            time.sleep(_EXIT_GRACE_S)
            return
        quiet = 0 if busy else quiet + 1


def _gloo_busy() -> bool | None:
    """Whether a gloo worker thread of this process is running or runnable (``None``: no /proc to tell)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("pt_gloo"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("R", "D"):
            return True
    return False


def done_reading(store, key: str, expected: int) -> None:
    """Count this rank, on ``store``'s counter ``key``, among the ranks that have read a failure's evidence (who
    arrived, who is stuck on whom); at exit, keep this process up until ``expected`` ranks have, or at most
    ``_LINGER_S``. The rank that gives up first may host the rendezvous store (rank 0 under a plain
    ``init_process_group``, ``mp.spawn``): its exit would take the evidence from the ranks still reading it.
    Registered with multiprocessing's exit hooks, which also run in ``mp.spawn``'s children (atexit does not)."""
    try:
        store.add(key, 1)
    except Exception:  # the store is gone already: nothing left to keep up
        return
    if not _readers:
        Finalize(None, _wait_for_readers, exitpriority=100)
    _readers[key] = (store, expected)


def _wait_for_readers(poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + _LINGER_S
    for key, (store, expected) in list(_readers.items()):
        try:
            while store.add(key, 0) < expected and time.monotonic() < deadline:
                time.sleep(poll_s)
        except Exception:  # the store (hosted elsewhere) is gone: nobody reads it any more
            pass
    _readers.clear()


def group_store(group):
    """The key-value store of ``group``'s rendezvous (``None`` if torch keeps none we can reach)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_process_group_store(group) if group is not None else c10d._get_default_store()
    except Exception:  # private API: without it failures are still reported, only less precisely
        return None


def publish_refusal(group, rank: int, why: str) -> None:
    """Leave this rank's reason for refusing its arguments where :func:`silent_ranks` finds it."""
    store = group_store(group)
    try:
        if store is not None:
            store.set(f"tokenring/refused/{rank}", why[:2000])
    except Exception:  # reporting only: the refusal itself is raised whatever happens here
        pass


def process_mark() -> str:
    """This process as the rendezvous store keeps it per rank (``tokenring/pid/<rank>``): host and pid."""
    return f"{socket.gethostname()} {os.getpid()}"


marked: set = set()  # ids of the groups this process has left its mark in (agreement.forget_groups clears it)


def mark_process(group, rank: int) -> None:
    """Leave :func:`process_mark` in ``group``'s store as rank ``rank``'s, once per group."""
    if id(group) in marked:
        return
    marked.add(id(group))
    try:
        group_store(group).set(f"tokenring/pid/{rank}", process_mark())
    except Exception:  # no store to reach: failures are still reported, only less precisely
        pass


def exited_ranks(store, ranks, wait_s: float = 0.0) -> list[int]:
    """Those of ``ranks`` whose process ran on this host and has exited (its pid gone, or a zombie), from the marks
    each rank leaves at its first exchange (:func:`tokenring.agreement.exchange`): a failed operation on a closed
    connection does not always say which peer closed it."""
    if store is None:
        return []
    pids, host = {}, socket.gethostname()
    for r in ranks:
        try:
            if store.check([f"tokenring/pid/{r}"]):
                where, pid = store.get(f"tokenring/pid/{r}").decode().rsplit(" ", 1)
                if where == host:
                    pids[r] = int(pid)
        except Exception:  # the store is gone, or a mark from elsewhere
            continue
    deadline = time.monotonic() + wait_s
    while True:  # a connection closes as its process exits, a moment before the process is gone
        out = [r for r, pid in pids.items() if not _running(pid)]
        if out or not pids or time.monotonic() >= deadline:
            return out
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel (a zombie counts as running there)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def silent_ranks(store, me: int, first: int, world: int, wait_s: float = _REPORT_WAIT_S) -> str:
    """A sentence naming the rank that stopped, following the failure reports from rank ``first`` ('' if it
    cannot be told; docs/internals.md). Counts this rank among the readers of the reports (:func:`done_reading`:
    the others, ``world - 1`` when one rank stopped, may still be following the chain)."""
    if store is None:
        return ""
    try:
        return _follow(store, me, first, wait_s, world)
    finally:
        done_reading(store, "tokenring/stuck_read", world - 1)


def _follow(store, me: int, first: int, wait_s: float, world: int) -> str:
    chain, r = [me], first
    deadline = time.monotonic() + wait_s
    try:
        while r not in chain:
            key, refused = f"tokenring/stuck/{r}", f"tokenring/refused/{r}"
            if store.check([refused]) and not store.check([key]):
                return (
                    f" Rank {r} is the one that stopped: it refused its arguments to attention (at this or an "
                    f"earlier call; the ranks had agreed on these shapes before, so the others went ahead "
                    f"without it): {store.get(refused).decode()} (tokenring.configure(check_calls=True) on every "
                    f"rank makes such a refusal a ValueError on every rank, the group usable, at one small "
                    f"exchange per call)"
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
        return _exited(store, me, world) or (
            f" Every rank of {chain} is waiting for the next: a schedule deadlock (please report it)."
        )
    except Exception:
        return _exited(store, me, world)


def _exited(store, me: int, world: int, wait_s: float = 0.0) -> str:
    """A sentence naming a rank whose process exited without a failure report of its own ('' if none)."""
    try:
        gone = [r for r in exited_ranks(store, [r for r in range(world) if r != me], wait_s)
                if not store.check([f"tokenring/stuck/{r}"])]  # fmt: skip
    except Exception:
        return ""
    return f" Rank {gone[0]} is the one that stopped: its process has exited." if gone else ""


class Trace:
    """Timeline events (seconds): one dict per compute block or message (docs/internals.md, "Communication")."""

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


@lru_cache(maxsize=256)
def _kind_tag(kind: str, heads: str) -> int:
    """The part of a message's tag that tells its kind and heads apart."""
    return message_kind(kind).tag * len(HEADS) + HEADS.index(heads)


def _tag(m: Message, posted: int, nth: int) -> int:
    """Message ``m``'s tag: the step its sender posted it at, its place among that step's messages between the
    pair, its kind and heads (a pair's operations match by tag)."""
    return (posted * _PAIR_SLOTS + nth) * len(KINDS) * len(HEADS) + _kind_tag(m.kind, m.heads)


def process_group(group):
    """The process group object ``group`` stands for (``None``: the default group's), as a cached replay is
    bound to it (a weak reference: a group destroyed and made anew is another object)."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def due_step(m: Message, posted: int) -> int:
    """The step at whose end message ``m``, posted at step ``posted``, is waited for."""
    return posted if m.due < 0 else m.due


def _peer(direction: str, m: Message) -> int:
    """The other end of ``m`` for the rank that sends (``"send"``) or receives (``"recv"``) it."""
    return m.dst if direction == "send" else m.src


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group):
    """Post one all-gather of ``x`` (1, ...) into ``out`` (P, ...), rank order; the work. Looked up per call
    (``all_gather_single``; ``all_gather_into_tensor`` before torch 2.13), so that a wrapped ``dist`` sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=group, async_op=True)


class Packed(list):
    """Tensors that are views of one flat byte buffer ``flat`` (what one message travels as)."""

    flat: torch.Tensor


def buffers(specs, device) -> Packed:
    """Receive buffers for a message of tensors ``specs``: views of one buffer (:func:`pack`'s layout)."""
    out = Packed()
    if len(specs) == 1:  # one tensor travels as itself (what pack sends for one)
        out.flat = torch.empty(specs[0][0], dtype=specs[0][1], device=device)
        out.append(out.flat)
        return out
    how, spans, total = _layout(specs if isinstance(specs, tuple) else tuple(tuple(x) for x in specs))
    if how is _Lay.STACKED:  # tensors of one shape and dtype (K and V): one (n, *shape) buffer
        shape, dtype = specs[0][0], specs[0][1]
        out.flat = torch.empty((len(specs), *shape), dtype=dtype, device=device)
        out.extend(out.flat.unbind(0))
    elif how is _Lay.ONE_DTYPE:  # (an output and its lse in float32): end to end in one buffer of that dtype
        out.flat = torch.empty(total, dtype=specs[0][1], device=device)
        out.extend(p.view(spec[0]) for p, spec in zip(out.flat.split_with_sizes(spans), specs))
    else:
        out.flat = torch.empty(total, dtype=torch.uint8, device=device)
        out.extend(out.flat[off : off + n].view(dtype).view(shape) for off, n, dtype, shape in spans)
    return out


def _stacked(shapes_dtypes: list) -> bool:
    """Whether a message of these ``(shape, dtype)`` travels stacked: several tensors of one shape and dtype."""
    return len(shapes_dtypes) > 1 and all(x == shapes_dtypes[0] for x in shapes_dtypes)


class _Lay(Enum):
    """How a message's tensors lie in its one buffer (:func:`_layout`)."""

    STACKED = "stacked"  # one shape and dtype: a (n, *shape) buffer
    ONE_DTYPE = "one dtype"  # one dtype: end to end in a buffer of it
    BYTES = "bytes"  # else: each at an _ALIGN-aligned byte offset


@lru_cache(maxsize=1024)
def _layout(specs: tuple) -> tuple[_Lay, list, int]:
    """How a message of ``specs`` ``(shape, dtype, ...)`` lies in its buffer: ``(how, spans, total)``; for
    ``ONE_DTYPE`` the spans are element counts and the total is in elements, for ``BYTES`` the spans are
    ``(offset, bytes, dtype, shape)`` and the total is in bytes."""
    if _stacked([(tuple(shape), dtype) for shape, dtype, *_ in specs]):
        return _Lay.STACKED, [], 0
    if all(dtype == specs[0][1] for _, dtype, *_ in specs):
        counts = [math.prod(shape) for shape, *_ in specs]
        return _Lay.ONE_DTYPE, counts, sum(counts)
    spans, total = [], 0
    for shape, dtype, *_ in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        spans.append((total, nbytes, dtype, shape))
        total += -(-nbytes // _ALIGN) * _ALIGN
    return _Lay.BYTES, spans, total


def pack(tensors: list[torch.Tensor], how: _Lay | None = None) -> torch.Tensor:
    """One contiguous buffer holding ``tensors`` as :func:`buffers` lays them out; ``how``: their layout, where
    the caller knows it (:class:`Posting`)."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    if how is None:  # (the one rule buffers() lays a message out by)
        how = _layout(tuple((tuple(t.shape), t.dtype) for t in tensors))[0]
    if how is _Lay.STACKED:
        return torch.stack(tensors)
    if how is _Lay.ONE_DTYPE:  # end to end
        return torch.cat([t.reshape(-1) for t in tensors])
    views = buffers(tuple((tuple(t.shape), t.dtype) for t in tensors), tensors[0].device)
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
    """A posted operation, waited for at most once (gloo: a second wait waits for another transfer)."""

    __slots__ = ("work", "done")

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
    """Posted operations of one step that are due together; ``recvs``: the ``(message, buffers)`` received."""

    __slots__ = ("comm", "step", "due", "works", "records", "recvs", "copies", "t0", "posted")

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
    """Point-to-point engine for one call on one rank of ``group``; ``log``: one record per message,
    ``stage``: copy tensors through host memory (docs/internals.md); ``rank``, ``world``: this rank's and the
    group's size, where the caller knows them."""

    def __init__(
        self,
        group=None,
        timeout: float | None = None,
        trace: Trace | None = None,
        what: str = "",
        stage: bool | str | None = None,
        log: bool = True,
        rank: int | None = None,
        world: int | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world = dist.get_world_size(group) if world is None else world
        backend = dist.get_backend(group)
        self.bounded = not device.nccl(group, backend)
        self.batched = not self.bounded  # a step's operations posted as one batch (NCCL coalesces it)
        # early receives (Message.ready) only where a pair's operations match by tag: gloo
        self.early_receives = backend == "gloo"
        self.stage = backend == "gloo" if stage is None else stage
        self.timeout = settings.get("timeout") if timeout is None else timeout
        self.trace = trace
        self.what = what
        self.log: list[dict] = []
        self.records = log or trace is not None  # a record per message (its dict costs host time per call)
        mark_process(group, self.rank)

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _who_stopped(self, peer: int) -> str:
        """Publish that this rank gave up waiting for ``peer``; name the rank at the end of the chain (gloo)."""
        if not self.bounded:
            return ""
        store = group_store(self.group)
        try:
            store.set(f"tokenring/stuck/{self.rank}", str(peer))
        except Exception:
            return ""
        return silent_ranks(store, self.rank, peer, self.world)

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

    def gather(self, step: int, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (the same shape and dtype on each), stacked in rank order ``(P, *x.shape)``: one
        all-gather (through host memory where the backend needs it), logged as one receive of the others' rows.
        A failure within the timeout is a RuntimeError naming a rank whose process has exited, where one has."""
        staged = self._host(x)
        src = (x.to("cpu") if staged else x).contiguous()
        out = src.new_empty((self.world, *src.shape))
        try:
            work = all_gather_into(out, src.unsqueeze(0), self.group)
            if self.bounded:
                work.wait(datetime.timedelta(seconds=self.timeout))
            else:
                work.wait()
        except Exception as e:
            who = _exited(group_store(self.group), self.rank, self.world, _REPORT_WAIT_S)
            raise RuntimeError(
                f"tokenring{(' ' + self.what) if self.what else ''}: rank {self.rank} failed gathering every "
                f"rank's step-{step} partials within {self.timeout:.0f} s: {e}.{who} A rank has died or is not "
                f"calling the same step. The process group cannot be used again after this: destroy it and start "
                f"the ranks again."
            ) from e
        if self.records:
            self.log.append(dict(step=step, due=step, direction="recv", peer=-1, kind="out", owner=-1, part="all",
                                 heads="all", staged=staged, device=out.device.type,
                                 bytes=(self.world - 1) * x.numel() * x.element_size()))  # fmt: skip
        return out.to(x.device) if staged else out

    def _host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` travels through host memory."""
        return self.stage == "always" or (bool(self.stage) and t.device.type != "cpu")

    def _op(self, direction: str, m: Message, tensors, posted: int, nth: int, got: list, copies: list):
        """The point-to-point operation of one message as ``((direction, peer, tag, m), buffer)``, and whether
        it is staged through the host; a receive adds itself to ``got`` and the copies to make after its wait
        to ``copies``."""
        tag, staged = _tag(m, posted, nth), False
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
        return ((direction, _peer(direction, m), tag, m), buf), staged

    def _post(self, ops: list[tuple], bufs: list) -> list:
        """Post operations ``(direction, peer, tag, message)`` of ``bufs``: one coalesced batch on NCCL, else each
        straight on the process group (what ``batch_isend_irecv`` does there, without its per-operation checks)."""
        if self.batched:
            return dist.batch_isend_irecv(
                [dist.P2POp(dist.isend if d == "send" else dist.irecv, buf, self._global(peer), self.group, tag)
                 for (d, peer, tag, _), buf in zip(ops, bufs)]
            )  # fmt: skip
        pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        send, recv = pg.send, pg.recv
        return [
            send([b], peer, tag) if d == "send" else recv([b], peer, tag) for (d, peer, tag, _), b in zip(ops, bufs)
        ]

    def start(
        self,
        step: int,
        sends: list[tuple[Message, list[torch.Tensor], tuple[int, int]]],
        recvs: list[tuple[Message, list[torch.Tensor], tuple[int, int]]],
    ) -> list[_Pending]:
        """Post ``recvs`` then ``sends`` in one batch, each with ``(step posted by its sender, n)`` for its tag;
        returns one handle per due step (docs/internals.md, "Communication")."""
        now = self.trace.now() if self.trace is not None else None
        ops, bufs = [], []
        groups: dict[int, tuple[list, list, list, list]] = {}  # due -> (op indices, records, received, copies)
        for direction, items in (("recv", recvs), ("send", sends)):
            for m, tensors, (posted, nth) in items:
                due = due_step(m, posted)
                idx, records, got, copies = groups.setdefault(due, ([], [], [], []))
                (op, buf), staged = self._op(direction, m, tensors, posted, nth, got, copies)
                idx.append(len(ops))
                ops.append(op)
                bufs.append(buf)
                if self.records:
                    records.append(
                        dict(step=step, due=due, direction=direction, peer=op[1], kind=m.kind, owner=m.owner,
                             part=str(m.part), heads=m.heads, staged=staged, device=buf.device.type,
                             bytes=sum(t.numel() * t.element_size() for t in tensors))
                    )  # fmt: skip
        if not ops:
            return []
        return list(self._launch(step, ops, bufs, [(due, *groups[due]) for due in sorted(groups)], now).values())

    def post(self, p: "Posting", sends: list[list[torch.Tensor]], recvs: list[Packed]) -> dict[int, _Pending]:
        """A recorded step's :meth:`start` (``p``: its messages; ``sends``: each message's tensors, ``recvs``:
        each receive's buffers from :func:`buffers`), by due step, without what start() works out per call:
        tags, peers, layouts and the due steps come from ``p``. Records and host staging take start()."""
        if self.records or (self.stage and (self.stage == "always" or not p.cpu)):
            got = self.start(
                p.step,
                [(m, ts, at) for (m, at), ts in zip(p.sends, sends)],
                [(m, bufs, at) for (m, at), bufs in zip(p.recvs, recvs)],
            )
            return {x.due: x for x in got}
        bufs = [b.flat for b in recvs]
        for ts, how in zip(sends, p.packs):
            bufs.append(ts[0].contiguous() if how is None else pack(ts, how))
        return self._launch(p.step, p.ops, bufs, p.dues, None)

    def _launch(self, step: int, ops: list, bufs: list, dues: list, now) -> dict[int, _Pending]:
        """Post ``ops`` ``(direction, peer, tag, message)`` of ``bufs``; a handle per due step for each ``(due,
        op indices, records, received, copies)`` of ``dues``. A handle keeps its buffers until its wait."""
        t0 = time.monotonic()
        try:
            handles = self._post(ops, bufs)
        except Exception as e:  # a peer that is already gone can fail the posting itself: name that one
            peers = sorted({peer for _, peer, _, _ in ops})
            gone = exited_ranks(group_store(self.group), peers, wait_s=_REPORT_WAIT_S)
            direction, _, _, m = next((x for x in ops if x[1] in gone), ops[0])
            raise self.failure(direction, m, step, e) from e
        if len(handles) != len(ops):  # NCCL: one coalesced work completes every operation of the step
            one, every = _Once(handles[0]), [(d, m) for d, _, _, m in ops]
            works = [(d, every, one, b) for (d, _, _, _), b in zip(ops, bufs)]
        else:
            works = [(d, m, _Once(h), b) for (d, _, _, m), h, b in zip(ops, handles, bufs)]
        out = {}
        for due, idx, records, got, copies in dues:
            if records:
                self.log.extend(records)
            out[due] = _Pending(self, step, due, [works[i] for i in idx], records, got, copies, t0, now)
        return out


class Posting:
    """One step's messages as a program posts them (:meth:`Comm.post`): what :meth:`Comm.start` would work out
    per call, worked out once. ``sends``, ``recvs``: ``(message, (posted, nth))``; ``ops``: ``(direction, peer,
    tag, message)`` per operation, receives first; ``packs``: each send's layout; ``dues``: ``(due, op indices,
    no records, no received, no copies)`` in due order; ``cpu``: every buffer in host memory (never staged)."""

    __slots__ = ("step", "sends", "recvs", "ops", "packs", "dues", "cpu")

    def __init__(self, step: int, sends: list, recvs: list, specs: list, cpu: bool):
        """``specs``: each send's tensors as ``(shape, dtype)``."""
        self.step, self.sends, self.recvs, self.cpu = step, tuple(sends), tuple(recvs), cpu
        self.ops = tuple(
            (d, _peer(d, m), _tag(m, posted, nth), m)
            for d, items in (("recv", recvs), ("send", sends))
            for m, (posted, nth) in items
        )
        self.packs = tuple(None if len(sp) == 1 else _layout(tuple(sp))[0] for sp in specs)
        by_due: dict[int, list] = {}
        for i, (m, (posted, _)) in enumerate(self.recvs + self.sends):  # (the order of self.ops)
            by_due.setdefault(due_step(m, posted), []).append(i)
        self.dues = [(due, by_due[due], (), (), ()) for due in sorted(by_due)]


def _moved(x: torch.Tensor, moves, out_rows: int, group, backward: bool) -> torch.Tensor:
    """``x`` (B, rows, ...) after ``moves`` (:class:`tokenring.layouts.Move`, each rank pair once: one tag
    suffices), ``out_rows`` rows; ``backward``: the moves undone (each from its ``dst`` back to its ``src``)."""
    rank = dist.get_rank(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    host = not device.nccl(group) and x.device.type != "cpu"  # gloo moves host memory
    out = x.new_empty(x.shape[0], out_rows, *x.shape[2:])
    keep = min(x.shape[1], out_rows)
    out[:, :keep] = x[:, :keep]
    ops, landed = [], []
    for m in moves:
        (src, a), (dst, b) = (
            ((m.dst, m.dst_row), (m.src, m.src_row)) if backward else ((m.src, m.src_row), (m.dst, m.dst_row))
        )
        if src == rank:
            buf = x[:, a : a + m.rows].contiguous()
            ops.append(dist.P2POp(dist.isend, buf.cpu() if host else buf, glob(dst), group))
        elif dst == rank:
            buf = x.new_empty(x.shape[0], m.rows, *x.shape[2:], device="cpu" if host else x.device)
            ops.append(dist.P2POp(dist.irecv, buf, glob(src), group))
            landed.append((b, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            wait_collective(work, group, "tokenring: moving rows between ranks", "a peer has probably died")
    for b, buf in landed:
        out[:, b : b + buf.shape[1]] = buf
    return out


class _MoveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, moves, out_rows, group, back):
        ctx.moves, ctx.in_rows, ctx.group, ctx.back = moves, x.shape[1], group, back
        return _moved(x, moves, out_rows, group, backward=back)

    @staticmethod
    def backward(ctx, dy):
        return _moved(dy.contiguous(), ctx.moves, ctx.in_rows, ctx.group, backward=not ctx.back), None, None, None, None


def move_rows(x: torch.Tensor, moves, out_rows: int, group=None, back: bool = False) -> torch.Tensor:
    """This rank's ``x`` (B, rows, ...) once the ranks of ``group`` have made ``moves`` (the same on every rank;
    :func:`tokenring.layouts.even_out`), or undone them (``back``): ``out_rows`` rows, its first rows kept in
    place. Differentiable: the gradient goes back the way the rows came."""
    return _MoveRows.apply(x, moves, out_rows, group, back)
