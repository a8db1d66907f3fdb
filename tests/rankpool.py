"""A pool of P local gloo ranks that stay up across test cases (spawning dominates otherwise).

``pool.run(fn, *args)`` calls ``fn(rank, P, *args)`` on every rank (``fn`` must be importable: define it at
module level) and returns the per-rank results; an exception on any rank fails the call with every rank's
traceback. A rank that dies or hangs fails it too, within ``timeout``.
"""
from __future__ import annotations

import datetime
import os
import queue
import traceback

import torch.multiprocessing as mp

from tokenring.launch import free_port


def _worker(rank: int, P: int, port: int, inbox, outbox, threads: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=P, timeout=datetime.timedelta(seconds=120))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, P, *args)))
        except BaseException:  # report, keep serving
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, P: int, timeout: float = 300.0):
        self.P, self.timeout = P, timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = max(1, (os.cpu_count() or 2) // P)
        self.inboxes = [ctx.Queue() for _ in range(P)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, P, port, self.inboxes[r], self.outbox, threads),
                                  daemon=True) for r in range(P)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        for box in self.inboxes:
            box.put((fn, args))
        results, errors = [None] * self.P, []
        for _ in range(self.P):
            try:
                rank, ok, value = self.outbox.get(timeout=self.timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise AssertionError(f"rank pool (P={self.P}): no answer within {self.timeout} s; dead ranks: {dead}")
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return results

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
