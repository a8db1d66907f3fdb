#!/usr/bin/env python3
"""What a new packed mask costs a whole call: the same call with the documents of the call before, and with new
documents every call (packed training), side by side.

    .venv/bin/python bench/new_mask.py [--ranks 2 4] [--local 64 1024] [--calls 40]

P local gloo ranks (1 torch thread each), B=1, H=8, Hkv=2, d=64, float32, causal, zigzag, 16 random documents,
forward+backward. Per round, one call with the previous round's documents ("same") and one with documents never
seen before ("new"), in alternating order; the new mask's call pays the rank's own plan, the signature exchange
and, for ``auto``, the choice (made once per mask class). Per call: the slowest rank's wall time after a barrier.
Writes every call to ``bench/results/new_mask.json`` and prints medians and new/same ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

STRATEGIES = ["ring", "token_ring:relay", "token_ring:direct,c=1,k=1", "ulysses", "auto"]


def rounds(rank: int, P: int, s: int, calls: int, strategies: list[str]) -> list[dict]:
    import torch
    import torch.distributed as dist

    import tokenring

    S = s * P
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, s, h, 64, generator=g).requires_grad_() for h in (8, 2, 2))

    def documents(i: int) -> list[int]:
        return [0] + sorted(random.Random(i).sample(range(1, S), 15)) + [S]

    def call(spec: str, cu: list[int]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        tokenring.attention(q, k, v, causal=True, strategy=spec, cu_seqlens=cu).sum().backward()
        return time.perf_counter() - t0

    out = []
    for spec in strategies:
        call(spec, documents(-1))  # warm-up: kernels, the unmasked choice's cache
        for i in range(calls):
            seen = documents(1_000_000 + i - 1 if i else -1)
            times = {}
            for how in ("same", "new") if i % 2 else ("new", "same"):
                times[how] = call(spec, seen if how == "same" else documents(1_000_000 + i))
            out.append(dict(strategy=spec, call=i, **times))
    return out


def main(argv=None) -> int:
    from tokenring.tools.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--local", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES)
    a = ap.parse_args(argv)
    rows, table = [], []
    for P in a.ranks:
        for s in a.local:
            per_rank = spawn(rounds, P, s, a.calls, a.strategies, timeout=3600)
            for j, row in enumerate(per_rank[0]):  # the slowest rank per call
                rows.append(dict(P=P, s=s, **{**row, **{h: max(r[j][h] for r in per_rank) for h in ("same", "new")}}))
            for spec in a.strategies:
                mine = [r for r in rows if (r["P"], r["s"], r["strategy"]) == (P, s, spec)]
                same, new = median(r["same"] for r in mine) * 1e3, median(r["new"] for r in mine) * 1e3
                table.append(dict(P=P, s=s, strategy=spec, same_ms=same, new_ms=new, ratio=new / same))
                print(f"P={P} s={s:5d} {spec:26s} same documents {same:8.2f} ms, new documents {new:8.2f} ms: "
                      f"{new / same:.2f}x (medians of {len(mine)})", flush=True)  # fmt: skip
    out = dict(
        command="python bench/new_mask.py " + " ".join(argv or sys.argv[1:]),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count()),
        shape="B=1, H=8, Hkv=2, d=64, float32, causal, zigzag, 16 random documents, forward+backward",
        medians=table,
        calls=rows,
    )
    with open(os.path.join(HERE, "results", "new_mask.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
