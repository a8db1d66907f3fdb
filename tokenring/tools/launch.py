"""Local ranks: ``P`` processes on this machine joined by one process group (gloo on CPU by default), the
machinery behind the demo, the benchmark, the examples and the tests.

The ranks rendezvous through a file (torch's ``FileStore``) in a private temporary directory, not through
torch's TCP store, which listens on every interface: a local run opens no port beyond loopback. Gloo's own
sockets are bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo``) unless the caller chose another one
(the testbed gives each network namespace its own).

    results = spawn(fn, 4, *args)            # fn(rank, P, *args) on 4 fresh ranks; per-rank return values

    with RankPool(4) as pool:                # persistent ranks (spawning dominates short jobs)
        a = pool.run(fn, *args)
        b = pool.run(other, *args)

    start_ranks_with("forkserver", ["torch", "tokenring"])   # later ranks fork from a server that imported these

    init_rank(rank, P, store_dir)            # inside a process you started yourself (see tools/bench.py)
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from multiprocessing.util import Finalize
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_rank", "RankPool", "RankError", "spawn", "exit_at_step", "start_ranks_with"]

_START = "spawn"  # how ranks start when the caller does not say (start_ranks_with)


def start_ranks_with(method: str, preload: list[str] | None = None) -> None:
    """How :class:`RankPool` and :func:`spawn` start ranks from now on when not told: ``"spawn"`` (the default: a
    fresh interpreter per rank, which imports torch anew, about 5 s for 4 ranks on 2 cores), ``"forkserver"``
    (a server process, started once, imports ``preload`` and forks each rank from itself: about 0.05 s; the test
    suite uses it) or ``"fork"``. A forked rank gets the caller's environment variables as they are at its start,
    as a spawned one does."""
    global _START
    if method not in mp.get_all_start_methods():
        raise ValueError(f"start method {method!r} is not available here: one of {mp.get_all_start_methods()}")
    if method == "forkserver" and preload:
        mp.get_context("forkserver").set_forkserver_preload(list(preload))
    _START = method


def init_rank(
    rank: int, P: int, store_dir: str, *, backend: str = "gloo", threads: int | None = None, timeout_s: float = 600.0
) -> None:
    """Join this process to a ``P``-rank process group as ``rank``, rendezvousing through the file
    ``<store_dir>/store`` (every rank must see the same ``store_dir``, which must start without a ``store``
    file in it). Sets ``threads`` torch threads when given. Gloo (and NCCL's bootstrap) bind to ``lo`` unless
    ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``) is already set."""
    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.FileStore(os.path.join(store_dir, "store"), P)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=P, timeout=datetime.timedelta(seconds=timeout_s)
    )


class RankError(RuntimeError):
    """A call on a :class:`RankPool` failed: the message holds every failing rank's traceback, or says which
    rank exited or did not answer."""


def _worker(rank: int, P: int, store_dir: str, threads: int, timeout_s: float, inbox, outbox, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, now (a forkserver's children would have the server's, from its start)
    init_rank(rank, P, store_dir, threads=threads, timeout_s=timeout_s)
    try:
        while True:
            job = inbox.get()
            if job is None:
                break
            fn, args = job
            try:
                answer = (rank, True, pickle.dumps(fn(rank, P, *args)))
            except BaseException:  # report, keep serving
                answer = (rank, False, traceback.format_exc())
            outbox.put(answer)
    finally:
        dist.destroy_process_group()


def _stop(procs: list, inboxes: list, store_dir: str, grace: float) -> None:
    """Ask the workers to leave, kill those that do not within ``grace`` seconds, remove the store."""
    for p, box in zip(procs, inboxes):
        if p.is_alive():
            try:
                box.put(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    shutil.rmtree(store_dir, ignore_errors=True)


class RankPool:
    """``P`` local ranks that stay up across calls. ``run(fn, *args)`` calls ``fn(rank, P, *args)`` on every
    rank (``fn`` importable: defined at module level) and returns the per-rank results. An exception on any
    rank fails the call with every failing rank's traceback (:class:`RankError`); so does a rank that exits or
    hangs, within ``timeout`` seconds (``None``: no limit). After a rank died or hung the pool starts fresh
    ranks for the next call. ``threads``: torch threads per rank (default: the cores shared out evenly).
    ``start``: how ranks start, ``"spawn"`` (a fresh interpreter), ``"forkserver"`` or ``"fork"`` (a copy of this
    process, with its imports: fast restarts for a fault soak; the caller must not have run threaded torch ops
    before); by default as :func:`start_ranks_with` last said ("spawn")."""

    def __init__(self, P: int, threads: int | None = None, timeout: float | None = 300.0, start: str | None = None):
        self.P, self.timeout = P, timeout
        self.threads = threads or max(1, (os.cpu_count() or 2) // P)
        self._ctx = mp.get_context(start or _START)
        self._procs: list = []
        self._finalizer = None
        self._broken = False  # a rank died or hung: start fresh ranks before the next call
        self._start()

    def _start(self) -> None:
        self.store_dir = tempfile.mkdtemp(prefix="tokenring-ranks-")
        self._inboxes = [self._ctx.Queue() for _ in range(self.P)]
        self._outbox = self._ctx.Queue()
        pg_timeout = self.timeout if self.timeout else 600.0
        self._procs = [
            self._ctx.Process(
                target=_worker,
                name=f"tokenring-rank-{r}",
                args=(
                    r,
                    self.P,
                    self.store_dir,
                    self.threads,
                    pg_timeout,
                    self._inboxes[r],
                    self._outbox,
                    dict(os.environ),
                ),
            )
            for r in range(self.P)
        ]
        for p in self._procs:
            p.start()
        self._broken = False
        # run before multiprocessing joins its children at interpreter exit (they are not daemons, so that a
        # rank may start processes of its own)
        self._finalizer = Finalize(
            self, _stop, args=(self._procs, self._inboxes, self.store_dir, 10.0), exitpriority=10
        )

    def _restart(self) -> None:
        """Stop the old ranks (killing those still stuck after 2 s) and their store; start fresh ones."""
        self._finalizer.cancel()
        _stop(self._procs, self._inboxes, self.store_dir, 2.0)
        self._start()

    def run(self, fn: Callable, *args, allow_exit: bool = False) -> list:
        """``fn(rank, P, *args)`` on every rank; the list of their return values. ``allow_exit``: a rank
        that exits without answering gives ``None`` instead of an error (the next call starts fresh ranks)."""
        if self._finalizer is None or not self._finalizer.still_active():
            raise RankError("this RankPool is closed")
        if self._broken or any(not p.is_alive() for p in self._procs):
            self._restart()
        for box in self._inboxes:
            box.put((fn, args))
        results, errors, exited = [None] * self.P, [], {}
        pending = set(range(self.P))
        gone: dict[int, float] = {}  # rank -> when it was first seen dead without having answered
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while pending:
            try:
                rank, ok, value = self._outbox.get(timeout=0.1)
            except queue.Empty:
                now = time.monotonic()
                for r in sorted(pending):
                    if not self._procs[r].is_alive():
                        # give an answer it sent just before exiting the time to arrive
                        if now - gone.setdefault(r, now) > 1.0:
                            pending.discard(r)
                            exited[r] = self._procs[r].exitcode
                if exited and not allow_exit:
                    break
                if deadline is not None and now > deadline:
                    self._broken = True
                    raise RankError(
                        f"rank pool (P={self.P}): ranks {sorted(pending)} gave no answer within "
                        f"{self.timeout} s; exited ranks: {sorted(exited) or 'none'}"
                        + ("\n" + "\n".join(errors) if errors else "")
                    )
                continue
            pending.discard(rank)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if exited:
            self._broken = True
            if not allow_exit:
                errors += [f"--- rank {r} exited with code {c} without answering ---" for r, c in exited.items()]
        if errors:
            raise RankError(f"rank pool (P={self.P}): {fn.__name__} failed\n" + "\n".join(errors))
        return results

    def close(self, grace: float = 10.0) -> None:
        """Stop the ranks (those that do not leave within ``grace`` seconds are killed) and remove the store.
        Idempotent."""
        if self._finalizer is not None and self._finalizer.still_active():
            self._finalizer.cancel()
            _stop(self._procs, self._inboxes, self.store_dir, grace)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spawn(fn: Callable, P: int, *args, threads: int | None = None, timeout: float | None = None) -> list:
    """Run ``fn(rank, P, *args)`` once on ``P`` fresh local ranks (``fn`` importable at module level);
    returns the per-rank return values, ``None`` for a rank that exited without returning. One thread per
    core share by default: the ranks share this machine's cores. ``timeout``: seconds (``None``: no limit)."""
    pool = RankPool(P, threads=threads, timeout=timeout)
    try:
        return pool.run(fn, *args, allow_exit=True)
    finally:
        pool.close(grace=2.0)  # the answers are in: a rank still leaving (a broken group's teardown) is killed


def exit_at_step(phase: str, step: int, code: int = 1, stall: float = 0.0) -> None:
    """Fault injection (tests, ``bench/fault_soak.py``): this process exits at once, like a crash (no cleanup),
    at the start of step ``step`` of its ``phase`` pass (``"forward"`` or ``"backward"``) of any later call;
    with ``stall`` seconds it sleeps there that long instead (alive, not progressing), once."""
    import time

    from .. import comm

    real_start, real_post, real_gather = comm.Comm.start, comm.Comm.post, comm.Comm.gather
    left = [1]

    def at(self, t):
        if self.what.endswith(phase) and t == step and left[0]:
            if not stall:
                os._exit(code)
            left[0] = 0
            time.sleep(stall)

    def start(self, t, sends, recvs):  # a step of the executor's loop
        at(self, t)
        return real_start(self, t, sends, recvs)

    def post(self, p, sends, recvs):  # a step of a program's replay
        at(self, p.step)
        return real_post(self, p, sends, recvs)

    def gather(self, t, x):  # decode's one step (the partials of every rank in one all-gather)
        at(self, t)
        return real_gather(self, t, x)

    comm.Comm.start, comm.Comm.post, comm.Comm.gather = start, post, gather
