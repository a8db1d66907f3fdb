#!/usr/bin/env python3
"""Training cost per call on CPU, before and after the fused backward kernel, next to one process.

    .venv/bin/python bench/fused_backward.py [--seq 8192] [--ranks 2 4] [--dtypes float32 bfloat16] [--repeats 3]

For each (P, dtype): P local gloo ranks (1 torch thread each, as a new user would run them on this machine),
causal (zigzag), H=8, d=64, B=1, forward+backward per call, strategies token_ring (the cost model's variant),
ring, ulysses and PyTorch's private ring attention, each with this library's backward kernel forced to the math
path ("before") and chosen per dtype ("after": the fused CPU kernel where it measured faster, see
``tokenring.kernels.cpu_backward_choice``); then one process running PyTorch SDPA forward+backward on the
whole sequence with as many threads as the machine has cores (the same cores the ranks share). Every
distributed output and gradient is checked against single-process attention by ``tokenring bench``.
Writes every timed call to ``bench/results/fused_backward.json`` and the table to ``fused_backward.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tokenring.tools import bench  # noqa: E402

ONE = r"""
import json, sys, time, torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
S, dt, reps = int(sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(1, 8, S, 64, generator=g).to(dt) for _ in range(4))
times = []
for i in range(reps + 1):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(do)
    times.append(time.perf_counter() - t0)
print(json.dumps(times[1:]))
"""


def one_process(S: int, dtype: str, repeats: int) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", ONE, str(os.cpu_count() or 1), str(S), dtype, str(repeats)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fused_backward"))
    a = ap.parse_args(argv)
    cases = []
    for P in a.ranks:
        for dtype in a.dtypes:
            one = one_process(a.seq, dtype, a.repeats)
            case = dict(P=P, dtype=dtype, one_process_s=one, one_process_median_s=median(one), runs={})
            for label, kernel in (("before", "math"), ("after", "auto")):
                spec = bench.make_spec(
                    P=P,
                    S=a.seq,
                    H=8,
                    d=64,
                    dtype=dtype,
                    causal=True,
                    mode="both",
                    strategies=["token_ring", "ring", "ulysses", "pytorch_ring"],
                    repeats=a.repeats,
                    trace=False,
                    comm_only=False,
                    backward_kernel=kernel,
                )
                res = bench.run(spec)
                case["runs"][label] = [
                    dict(
                        strategy=r["strategy"],
                        times_s=r.get("times"),
                        median_s=r.get("time"),
                        check=r.get("check"),
                        skipped=r.get("skipped"),
                    )
                    for r in res["results"]
                ]
                print(
                    f"P={P} {dtype} {label}: "
                    + ", ".join(f"{r['strategy']} {r['time']:.2f}s" for r in res["results"] if "time" in r),
                    flush=True,
                )
            cases.append(case)
    machine = bench.machine()
    out = dict(
        command="python bench/fused_backward.py " + " ".join(argv or sys.argv[1:]),
        machine=machine,
        shape=dict(
            S=a.seq,
            B=1,
            H=8,
            Hkv=8,
            d=64,
            causal=True,
            layout="zigzag",
            threads_per_rank=1,
            one_process_threads=os.cpu_count(),
        ),
        cases=cases,
    )
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    lines = [
        "# Forward+backward per call on CPU: math vs fused backward, vs one process",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, gloo. "
        f"S={a.seq}, B=1, H=8, d=64, causal (zigzag), P local ranks with 1 thread each; one process: SDPA "
        f"forward+backward on the whole sequence with {os.cpu_count()} threads. Median of {a.repeats} calls "
        f"[min-max]; ratio = median / one process. Command: `{out['command']}`.",
        "",
        "| P | dtype | strategy | before (math bwd) s | after (auto bwd) s | after / one process |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        before = {r["strategy"]: r for r in c["runs"]["before"]}
        for r in c["runs"]["after"]:
            if r["median_s"] is None:
                continue
            b = before.get(r["strategy"], {})
            fmt = lambda x: (
                f"{x['median_s']:.2f} [{min(x['times_s']):.2f}-{max(x['times_s']):.2f}]" if x.get("median_s") else "-"
            )
            lines.append(
                f"| {c['P']} | {c['dtype']} | {r['strategy']} | {fmt(b)} | {fmt(r)} | "
                f"{r['median_s'] / c['one_process_median_s']:.2f}x |"
            )
        lines.append(
            f"| {c['P']} | {c['dtype']} | one process (SDPA) | | {c['one_process_median_s']:.2f} "
            f"[{min(c['one_process_s']):.2f}-{max(c['one_process_s']):.2f}] | 1.00x |"
        )
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
