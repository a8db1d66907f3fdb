#!/usr/bin/env python3
"""What a length the layout does not split evenly costs: ``tokenring.attention`` at S = 4095 and 4097 (uneven
shards, padded internally) next to S = 4096 (even), per call, P local gloo ranks.

    .venv/bin/python bench/any_length.py [--ranks 4] [--rounds 5] [--calls 10]

B=1, H=8, Hkv=2, d=64, float32; causal (zigzag, token_ring) and not (contiguous, ring); forward (no grad) and
forward+backward. Lengths and passes run interleaved within each round; every call is kept (slowest rank's
seconds). Writes ``bench/results/any_length.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402

LENGTHS = (4096, 4095, 4097)
KINDS = ((True, "token_ring"), (False, "ring"))


def calls(rank: int, P: int, rounds: int, n: int) -> dict:
    """Milliseconds per call on this rank: ``{"causal|S|pass": [...]}``."""
    import torch

    import tokenring

    torch.manual_seed(0)
    out: dict = {}
    for _ in range(rounds):
        for causal, strategy in KINDS:
            layout = "zigzag" if causal else "contiguous"
            for S in LENGTHS:
                full = [torch.randn(1, S, h, 64) for h in (8, 2, 2)]
                q, k, v = (tokenring.shard(x, 1, layout).requires_grad_() for x in full)
                kw = dict(causal=causal, strategy=strategy, seq_len=S)
                for i in range(n + 1):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        tokenring.attention(q, k, v, **kw)
                    t1 = time.perf_counter()
                    tokenring.attention(q, k, v, **kw).sum().backward()
                    t2 = time.perf_counter()
                    if i:  # the first call plans and warms up
                        out.setdefault(f"{causal}|{S}|fwd", []).append((t1 - t0) * 1e3)
                        out.setdefault(f"{causal}|{S}|fwdbwd", []).append((t2 - t1) * 1e3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    a = ap.parse_args(argv)
    from tokenring.tools.launch import spawn

    per_rank = spawn(calls, a.ranks, a.rounds, a.calls)
    slowest = {key: [max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key]))] for key in per_rank[0]}
    rows, lines = [], []
    cmd = f".venv/bin/python bench/any_length.py --ranks {a.ranks} --rounds {a.rounds} --calls {a.calls}"
    lines += [
        f"# Any length: uneven shards vs an even length, P={a.ranks}",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo on loopback, "
        f"{a.ranks} ranks sharing them. B=1, H=8, Hkv=2, d=64, float32. Command: `{cmd}`. Median ms per call of "
        f"the slowest rank over {a.rounds} interleaved rounds x {a.calls} calls (quartiles), and the ratio to S=4096.",
        "",
        "| attention | pass | S=4096 | S=4095 | S=4097 | 4095 / 4096 | 4097 / 4096 |",
        "|---|---|---|---|---|---|---|",
    ]
    for causal, strategy in KINDS:
        for what in ("fwd", "fwdbwd"):
            cells, med = [], {}
            for S in LENGTHS:
                x = sorted(slowest[f"{causal}|{S}|{what}"])
                med[S] = median(x)
                cells.append(f"{med[S]:.1f} ({x[len(x) // 4]:.1f}-{x[3 * len(x) // 4]:.1f})")
            name = f"{'causal zigzag' if causal else 'full contiguous'}, {strategy}"
            ratios = [med[4095] / med[4096], med[4097] / med[4096]]
            rows.append(dict(causal=causal, strategy=strategy, pass_=what, median_ms=med, ratios=ratios))
            lines.append(f"| {name} | {what} | " + " | ".join(cells) + f" | {ratios[0]:.3f} | {ratios[1]:.3f} |")
    data = dict(command=cmd, ranks=a.ranks, rows=rows, calls_ms=slowest)
    _results.write(os.path.join(HERE, "results", "any_length"), data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
