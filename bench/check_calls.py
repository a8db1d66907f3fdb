#!/usr/bin/env python3
"""What ``tokenring.configure(check_calls=True)`` costs per call: the same attention calls with it off and on,
interleaved rounds, every call's time kept, on local gloo ranks. Writes ``bench/results/check_calls.{json,md}``:

    .venv/bin/python bench/check_calls.py --ranks 4 --rounds 5 --calls 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {"tiny": (1, 64, 4, 2, 16), "small": (1, 1024, 8, 2, 64)}  # (B, s per rank, H, Hkv, d)


def timed(rank: int, P: int, shape: tuple, on: bool, calls: int, backward: bool) -> list[float]:
    """``calls`` calls (after 2 untimed), each timed from a barrier to its end, with check_calls ``on``."""
    import torch
    import torch.distributed as dist

    import tokenring

    B, s, H, Hkv, d = shape
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, s, H, d, generator=g, requires_grad=backward)
    k, v = (torch.randn(B, s, Hkv, d, generator=g, requires_grad=backward) for _ in range(2))
    tokenring.configure(check_calls=on)
    out = []
    try:
        for i in range(calls + 2):
            dist.barrier()
            t0 = time.perf_counter()
            o = tokenring.attention(q, k, v, causal=True, strategy="ring")
            if backward:
                o.sum().backward()
            if i >= 2:
                out.append(time.perf_counter() - t0)
    finally:
        tokenring.configure(check_calls=None)
    return out


def main(argv=None) -> int:
    from tokenring.device import machine
    from tokenring.tools.launch import RankPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args(argv)
    res = dict(
        command=f"python bench/check_calls.py --ranks {a.ranks} --rounds {a.rounds} --calls {a.calls}",
        machine=machine(),
        shapes={k: dict(zip(("B", "s_per_rank", "H", "Hkv", "d"), v)) for k, v in SHAPES.items()},
        strategy="ring",
        dtype="float32",
        runs=[],
    )
    pool = RankPool(a.ranks)
    try:
        for r in range(a.rounds):
            for name, shape in SHAPES.items():
                for backward in (False, True):
                    for on in (False, True) if r % 2 == 0 else (True, False):  # interleaved, order alternating
                        every = pool.run(timed, shape, on, a.calls, backward)
                        per_call = [max(ts) for ts in zip(*every)]  # a call ends when its slowest rank does
                        res["runs"].append(dict(round=r, shape=name, backward=backward, check_calls=on, s=per_call))
    finally:
        pool.close()
    out = os.path.join(HERE, "results", "check_calls")
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(report(res))
    print(report(res))
    return 0


def report(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# check_calls: one signature exchange per attention call",
        "",
        f"Command: `{res['command']}`. Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}, "
        f"local gloo ranks; strategy {res['strategy']}, {res['dtype']}, causal. Per call: from a barrier to the "
        f"slowest rank's end; every call of every round kept in the JSON.",
        "",
        "| shape | pass | off: median ms (min-max of round medians) | on: median ms (min-max) | on / off |",
        "|---|---|---|---|---|",
    ]
    for name in res["shapes"]:
        for backward in (False, True):
            meds = {}
            for on in (False, True):
                rounds = [
                    statistics.median(r["s"]) * 1e3
                    for r in res["runs"]
                    if r["shape"] == name and r["backward"] == backward and r["check_calls"] == on
                ]
                meds[on] = (statistics.median(rounds), min(rounds), max(rounds))
            (a, a0, a1), (b, b0, b1) = meds[False], meds[True]
            lines.append(
                f"| {name} | {'fwd+bwd' if backward else 'fwd'} | {a:.2f} ({a0:.2f}-{a1:.2f}) | "
                f"{b:.2f} ({b0:.2f}-{b1:.2f}) | {b / a:.2f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
