#!/usr/bin/env python3
"""A silent or dead peer is named by every other rank, every time: P=4 local gloo ranks, rank 2 stops (alive but
never calling on the first call, the same on a later call, or dead before a later call), each scenario repeated,
under four launchers: tokenring's own (a file store), a plain ``init_process_group`` per process and ``mp.spawn``
(both with rank 0 hosting torch's TCP store) and torchrun (``tests/launcher_case.py``, in a fresh network
namespace).

    .venv/bin/python bench/silent_peer.py [--reps 10] [--timeout 2] [--strategies token_ring ring ulysses]
        [--launchers pool plain mp_spawn torchrun]

Writes every try to ``bench/results/silent_peer.json``: per surviving rank, the seconds from the start of the
failed call to its RuntimeError and whether the message names rank 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

STRATEGIES = ["token_ring", "ring", "ulysses"]  # the ones whose first-call naming was flaky
LAUNCHERS = ["pool", "plain", "mp_spawn", "torchrun"]


def one_try(launcher: str, strategy: str, when: str, timeout: float) -> list:
    """Per rank: (seconds, message) of each surviving rank (``None`` for the stopped one or a missing answer)."""
    import json
    import subprocess
    import tempfile

    if launcher == "pool":
        import cases

        from tokenring.tools.launch import spawn

        return spawn(cases.silent_case, 4, strategy, 2, when, timeout, timeout=120)
    case = os.path.join(os.path.dirname(HERE), "tests", "launcher_case.py")
    with tempfile.TemporaryDirectory() as out:
        run = f"ip link set lo up && exec {sys.executable} {case} {launcher} {strategy} {when} {timeout} {out}"
        subprocess.run(["unshare", "-n", "sh", "-c", run], timeout=120, capture_output=True)
        results = []
        for r in range(4):
            try:
                with open(os.path.join(out, f"{r}.json")) as f:
                    results.append(json.load(f))
            except OSError:
                results.append(None)
        return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES)
    ap.add_argument("--launchers", nargs="+", default=LAUNCHERS, choices=LAUNCHERS)
    a = ap.parse_args(argv)
    tries, bad = [], 0
    for rep in range(a.reps):
        for launcher in a.launchers:
            for strategy in a.strategies:
                for when in ("first", "later", "dead"):
                    results = one_try(launcher, strategy, when, a.timeout)
                    ranks = []
                    for rank in (0, 1, 3):
                        elapsed, msg = results[rank] or (float("inf"), "no answer")
                        named = "Rank 2 is the one that stopped" in msg
                        ok = named and elapsed < a.timeout + 2
                        bad += not ok
                        ranks.append(dict(rank=rank, seconds=elapsed, names_rank_2=named, ok=ok, message=msg[:300]))
                    tries.append(dict(rep=rep, launcher=launcher, strategy=strategy, when=when, ranks=ranks))
                    print(
                        f"{rep} {launcher:8s} {strategy:12s} {when:6s} "
                        + " ".join(f"{r['seconds']:.1f}s{'' if r['ok'] else '!'}" for r in ranks),
                        flush=True,
                    )
    res = dict(
        command="python bench/silent_peer.py " + " ".join(argv or sys.argv[1:]),
        machine=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        reps=a.reps,
        timeout_s=a.timeout,
        strategies=a.strategies,
        launchers=a.launchers,
        surviving_rank_reports=3 * len(tries),
        not_named_in_time=bad,
        tries=tries,
    )
    with open(os.path.join(HERE, "results", "silent_peer.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{3 * len(tries)} surviving-rank reports, {bad} not naming rank 2 within timeout + 2 s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
