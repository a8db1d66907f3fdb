#!/usr/bin/env python3
"""Planning time per call at large P: the first call builds the schedule and this rank's plan, later calls look
them up.

    .venv/bin/python bench/plan_time.py [--ranks 64 256 1024] [--lookups 2000]

What a call plans: the strategy from its spec (``tokenring.strategies.get``), the schedule
(``Strategy.schedule``, cached per P/layout/causal/pass) and this rank's per-step plan with its read index
(``tokenring.executor._rank_plan``, cached per schedule and rank). For each P, strategy and mask, forward and
backward: the first (building) call once, and the median of ``--lookups`` later calls. Writes
``bench/results/plan_time.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tokenring.executor import _rank_plan  # noqa: E402
from tokenring.strategies import get  # noqa: E402


def plan(spec: str, P: int, layout: str, causal: bool, backward: bool, rank: int):
    sched = get(spec).schedule(P, layout, causal, backward)
    return _rank_plan(sched, rank)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--strategies", nargs="+", default=["token_ring:relay", "ring", "ring_bidir", "ulysses"])
    ap.add_argument("--lookups", type=int, default=2000)
    a = ap.parse_args(argv)
    rows = []
    for P in a.ranks:
        for spec in a.strategies:
            for causal, layout in ((False, "contiguous"), (True, "zigzag")):
                for backward in (False, True):
                    rank = P // 3  # any rank: a middle one
                    t0 = time.perf_counter()
                    plan(spec, P, layout, causal, backward, rank)
                    first = time.perf_counter() - t0
                    laps = []
                    for _ in range(a.lookups):
                        t0 = time.perf_counter()
                        plan(spec, P, layout, causal, backward, rank)
                        laps.append(time.perf_counter() - t0)
                    rows.append(dict(P=P, strategy=spec, causal=causal, backward=backward, first_s=first,
                                     cached_median_us=median(laps) * 1e6, cached_max_us=max(laps) * 1e6))
                    r = rows[-1]
                    print(f"P={P:5d} {spec:18s} causal={causal!s:5s} {'bwd' if backward else 'fwd'}: first call "
                          f"{first:8.3f} s, later calls median {r['cached_median_us']:.2f} us "
                          f"(max {r['cached_max_us']:.1f} us)", flush=True)
    out = dict(command="python bench/plan_time.py " + " ".join(argv or sys.argv[1:]),
               machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                            python=platform.python_version()), rows=rows)
    with open(os.path.join(HERE, "results", "plan_time.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
