"""Spawn P local ranks joined by a gloo (CPU) process group on 127.0.0.1: the machinery behind the demo,
the benchmarks and the examples."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, P: int, port: int, threads: int, results, args: tuple) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=P, timeout=datetime.timedelta(seconds=600))
    try:
        out = fn(rank, P, *args)
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, P: int, *args, threads: int | None = None) -> list:
    """Run ``fn(rank, P, *args)`` on ``P`` local ranks (``fn`` importable at module level); returns the
    per-rank return values. One thread per rank by default: the ranks share this machine's cores."""
    threads = threads or max(1, (os.cpu_count() or 1) // P)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(fn, P, free_port(), threads, results, args), nprocs=P, join=True,
                       start_method="spawn")
    out = [None] * P
    while not results.empty():
        r, value = results.get()
        out[r] = value
    return out
