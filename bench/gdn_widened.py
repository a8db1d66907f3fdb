#!/usr/bin/env python3
"""What state passing costs a Gated DeltaNet layer in the kernel alone: transformers' torch
``torch_chunk_gated_delta_rule`` on one rank's rows as it runs unsharded (zero start, ``dv`` value columns) and as
``tokenring.recurrence.delta_rule`` runs it (the values widened by ``dk`` zero columns, the start ``[0 | I]``: one
pass gives the outputs, their dependence on the start state and the fragment's transition).

    .venv/bin/python bench/gdn_widened.py [--rows 4096] [--rounds 7]

One torch thread, float32, B=1, 8 value heads, the two calls interleaved per round after a warm-up, every call
kept. Writes ``bench/results/gdn_widened.{json,md}``.
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
import torch  # noqa: E402


def times(rows: int, heads: int, dk: int, dv: int, rounds: int) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as kernel

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, rows, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(1, rows, heads, dv, generator=g)
    gate, beta = -torch.rand(1, rows, heads, generator=g), torch.rand(1, rows, heads, generator=g)
    wide = torch.cat([v, v.new_zeros(1, rows, heads, dk)], -1)
    start = torch.zeros(1, heads, dk, dv + dk)
    start[..., dv:] = torch.eye(dk)
    calls = {
        "plain": lambda: kernel(q, k, v, g=gate, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True),
        "widened": lambda: kernel(
            q, k, wide, g=gate, beta=beta, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
        ),
    }
    out = {name: [] for name in calls}
    for f in calls.values():
        f()
    for _ in range(rounds):
        for name, f in calls.items():
            t0 = time.perf_counter()
            f()
            out[name].append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    data, rows = [], []
    for dk, dv in ((64, 64), (128, 128)):
        t = times(a.rows, 8, dk, dv, a.rounds)
        data.append(dict(rows=a.rows, heads=8, dk=dk, dv=dv, seconds=t))
        span = {n: f"{median(x):.3f} [{min(x):.3f}-{max(x):.3f}]" for n, x in t.items()}
        ratios = [w / p for w, p in zip(t["widened"], t["plain"])]
        rows.append(
            f"| {dk} | {dv} | {span['plain']} | {span['widened']} | {median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    cmd = " ".join([".venv/bin/python bench/gdn_widened.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        "# A Gated DeltaNet kernel call, plain and widened for state passing",
        "",
        f"Command: `{cmd}`. Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, one thread. transformers' `torch_chunk_gated_delta_rule`, {a.rows} rows, B=1, 8 "
        f"value heads, float32, {a.rounds} interleaved rounds after a warm-up: seconds, median [min-max]; ratio "
        f"per round, median (min-max).",
        "",
        "| dk | dv | plain (zero start) | widened (dk zero columns, start [0, I]) | widened / plain |",
        "|---|---|---|---|---|",
        *rows,
    ]
    _results.write(os.path.join(HERE, "results", "gdn_widened"), data, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
