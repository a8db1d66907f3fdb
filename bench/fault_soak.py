#!/usr/bin/env python3
"""Fault soak: many calls, each with one rank killed at a random step of its forward or backward.

    .venv/bin/python bench/fault_soak.py [--trials 200] [--timeout 2] [--seed 0]

Each trial: P in {2, 3, 4} fresh local gloo ranks (``RankPool``; after a death it starts fresh ones), a strategy
(token_ring relay and direct, ring, ring direct, ring_bidir, ulysses), causal or not, a warm-up call, then a call
in which the victim rank exits (``os._exit``) at the start of a random step of the forward or the backward.
Every surviving rank reports how its call ended: a ``RuntimeError`` (with the seconds from the start of that
pass, and whether the message names the victim), or completion (it needed nothing more from the victim).
A surviving rank that neither raises nor completes within the pool's limit is a hang. At the end, no process
started by the soak may be left. Writes every trial to ``bench/results/fault_soak.json`` and prints the counts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SPECS = ["token_ring:relay", "token_ring:direct,c=2,k=1", "ring", "ring:direct,c=2,k=1", "ring_bidir", "ulysses"]


def trial(rank: int, P: int, spec: str, causal: bool, phase: str, victim: int, kill_step: int, timeout: float):
    import torch

    import tokenring
    from tokenring.tools.launch import exit_at_step

    tokenring.set_timeout(timeout)
    layout = "zigzag" if causal else "contiguous"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, h, 8, generator=g).requires_grad_() for h in (12, 2, 2))
    tokenring.attention(q, k, v, causal=causal, strategy=spec, layout=layout).sum().backward()  # warm-up
    if rank == victim:
        exit_at_step(phase, kill_step)
    t0 = time.monotonic()
    try:
        out = tokenring.attention(q, k, v, causal=causal, strategy=spec, layout=layout)
        if phase == "backward":
            t0 = time.monotonic()
        out.sum().backward()
    except RuntimeError as e:
        return dict(
            outcome="raised",
            seconds=time.monotonic() - t0,
            names_victim=f"Rank {victim} is" in str(e) or f"rank {victim} (" in str(e),
            message=str(e)[:400],
        )
    return dict(outcome="completed", seconds=time.monotonic() - t0)


def leftover_children() -> list[int]:
    """Processes whose parent is this one (the soak's ranks must all be gone), except multiprocessing's
    resource tracker, which lives until this interpreter exits."""
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    tracker = b"resource_tracker" in f.read()
                if parent == me and not tracker:
                    out.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return out


def main(argv=None) -> int:
    from tokenring.strategies import get, why_not
    from tokenring.tools.launch import RankError, RankPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rnd = random.Random(a.seed)
    pools: dict[int, RankPool] = {}
    rows = []
    t_start = time.monotonic()
    try:
        for i in range(a.trials):
            P = rnd.choice([2, 3, 4])
            spec = rnd.choice([s for s in SPECS if why_not(s, 12, 2, P) is None])
            causal, phase = rnd.random() < 0.5, rnd.choice(["forward", "backward"])
            steps = len(get(spec).schedule(P, "zigzag" if causal else "contiguous", causal, phase == "backward").steps)
            victim, kill_step = rnd.randrange(P), rnd.randrange(steps)
            pool = pools.setdefault(P, RankPool(P, threads=1, timeout=a.timeout + 30))
            row = dict(
                trial=i, P=P, strategy=spec, causal=causal, phase=phase, victim=victim, kill_step=kill_step, steps=steps
            )
            try:
                res = pool.run(trial, spec, causal, phase, victim, kill_step, a.timeout, allow_exit=True)
                row["ranks"] = [None if r == victim else res[r] for r in range(P)]
                row["victim_answered"] = res[victim] is not None
            except RankError as e:  # a survivor that gave no answer in time: a hang
                row["hang"] = str(e)[:600]
            rows.append(row)
            surv = [r for r in row.get("ranks", []) if r]
            print(
                f"{i:3d} P={P} {spec:26s} {'causal' if causal else 'full  '} {phase:8s} kill r{victim}@{kill_step}: "
                + (
                    "HANG"
                    if "hang" in row
                    else ", ".join(
                        f"{r['outcome']} {r['seconds']:.1f}s"
                        + ("" if r["outcome"] != "raised" else (" named" if r["names_victim"] else " UNNAMED"))
                        for r in surv
                    )
                ),
                flush=True,
            )
    finally:
        for pool in pools.values():
            pool.close()
    time.sleep(1.0)
    left = leftover_children() + [p.pid for p in multiprocessing.active_children()]
    surv = [r for row in rows for r in row.get("ranks", []) if r]
    raised = [r for r in surv if r["outcome"] == "raised"]
    bound = a.timeout + 2.0
    summary = dict(
        trials=len(rows),
        surviving_rank_calls=len(surv),
        raised=len(raised),
        completed=sum(r["outcome"] == "completed" for r in surv),
        raised_within_bound=sum(r["seconds"] <= bound for r in raised),
        raised_naming_victim=sum(r["names_victim"] for r in raised),
        hangs=sum("hang" in row for row in rows),
        victim_answered=sum(row.get("victim_answered", False) for row in rows),
        slowest_raise_s=max((r["seconds"] for r in raised), default=None),
        bound_s=bound,
        leftover_processes=sorted(set(left)),
        wall_s=time.monotonic() - t_start,
    )
    out = dict(
        command="python bench/fault_soak.py " + " ".join(argv or sys.argv[1:]),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count()),
        summary=summary,
        trials=rows,
    )
    with open(os.path.join(HERE, "results", "fault_soak.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))
    ok = (
        summary["hangs"] == 0
        and not left
        and summary["victim_answered"] == 0
        and summary["raised_within_bound"] == len(raised)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
