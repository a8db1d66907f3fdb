#!/usr/bin/env python3
"""Long context on CPU: one causal forward+backward at S = 256K tokens on P = 4 local ranks; peak memory per rank.

    .venv/bin/python bench/long_context_memory.py [--seq 262144] [--ranks 4] [--heads 1] [--head-dim 64]
                                                  [--strategy token_ring]

Each rank: a warm-up call at a tiny length (so kernel libraries, thread pools and gloo buffers are not counted),
then one causal (zigzag) forward+backward in float32 at local length s = S/P; the growth of its peak resident
memory (``ru_maxrss``) over that call, its time, and the check of the gathered output rows against nothing but
finiteness (a float64 reference at 256K would need 2^36 scores). Memory is reported in units of one local
query-sized tensor ``u = s*H*d*4`` bytes, next to the design's bound: the inputs, the output and its fp32
accumulator, the gradients and their fp32 accumulators, dO, and at most two visiting blocks of each travelling
kind make fewer than ``24 u`` (plus the CPU kernel's per-thread tiles), i.e. linear in s: no s*s tensor exists.
Writes ``bench/results/long_context_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def rank_run(rank: int, P: int, s: int, H: int, d: int, strategy: str) -> dict:
    import resource

    import torch

    import tokenring

    def call(n):
        torch.manual_seed(rank)
        q, k, v = (torch.randn(1, n, H, d, requires_grad=True) for _ in range(3))
        out = tokenring.attention(q, k, v, causal=True, strategy=strategy)
        out.sum().backward()
        return bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all())

    call(256)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    finite = call(s)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(rank=rank, peak_growth_bytes=peak - before, peak_rss_bytes=peak, seconds=seconds, finite=finite)


def main(argv=None) -> int:
    from tokenring.tools.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=262144)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--strategy", default="token_ring")
    a = ap.parse_args(argv)
    P, s = a.ranks, a.seq // a.ranks
    unit = s * a.heads * a.head_dim * 4
    t0 = time.perf_counter()
    rows = spawn(rank_run, P, s, a.heads, a.head_dim, a.strategy, threads=1)
    wall = time.perf_counter() - t0
    for r in rows:
        r["peak_growth_units"] = r["peak_growth_bytes"] / unit
    out = dict(
        command="python bench/long_context_memory.py " + " ".join(argv or sys.argv[1:]),
        machine=dict(
            cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), python=platform.python_version()
        ),
        shape=dict(
            S=a.seq,
            P=P,
            s=s,
            B=1,
            H=a.heads,
            Hkv=a.heads,
            d=a.head_dim,
            dtype="float32",
            causal=True,
            layout="zigzag",
            strategy=a.strategy,
            threads_per_rank=1,
        ),
        unit_bytes=unit,
        bound_units=24,
        ranks=rows,
        wall_s=wall,
        score_block_bytes=s * s * 4,
    )
    with open(os.path.join(HERE, "results", "long_context_memory.json"), "w") as f:
        json.dump(out, f, indent=1)
    for r in rows:
        print(
            f"rank {r['rank']}: peak growth {r['peak_growth_bytes'] / 2**20:.0f} MiB = {r['peak_growth_units']:.1f} u "
            f"(u = s*H*d*4 = {unit / 2**20:.0f} MiB; one s*s fp32 score block would be {s * s * 4 / 2**30:.0f} GiB), "
            f"{r['seconds']:.0f} s, finite={r['finite']}"
        )
    ok = all(r["finite"] and r["peak_growth_units"] < 24 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
