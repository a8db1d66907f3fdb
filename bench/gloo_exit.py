#!/usr/bin/env python3
"""Does a 2-rank gloo script abort at exit? Each run starts two local ranks that all_reduce a tensor three times
and end without destroying their group, with or without ``tokenring.comm.guard_exit`` (at exit, it waits until
gloo's worker threads are idle, so that they release the last collective's tensors before Python finalizes); on
the idle machine and with ``--load`` busy processes beside (as when other tests run).

    .venv/bin/python bench/gloo_exit.py [--runs 30] [--load 0 3]

Writes every run's exit codes to ``bench/results/gloo_exit.{json,md}``; -6 is SIGABRT ("terminate called
without an active exception", after the script printed its results).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def rank_main(guard: bool) -> None:
    """One rank: three all_reduces of tensors Python made, then the end of the script."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if guard:
        from tokenring.comm import guard_exit

        guard_exit(dist.group.WORLD)
    for _ in range(3):
        t = torch.ones(1000)
        dist.all_reduce(t)
        t.sum().item()


def one_run(guard: bool) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", WORLD_SIZE="2")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    args = [sys.executable, __file__, "--rank-main", "guard" if guard else "plain"]
    procs = [
        subprocess.Popen(args, env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(2)
    ]
    return [p.wait(timeout=120) for p in procs]


def main(argv=None) -> int:
    from _results import write

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--load", type=int, nargs="+", default=[0, 3], help="busy processes beside the ranks")
    a = ap.parse_args(argv)
    runs = {f"{name}, load {n}": [] for n in a.load for name in ("plain", "guard_exit")}
    t0 = time.time()
    for n in a.load:
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        try:
            for i in range(a.runs):
                for name in ("plain", "guard_exit"):  # interleaved, so that both see the same machine
                    runs[f"{name}, load {n}"].append(one_run(name == "guard_exit"))
                print(n, i, {k: v[-1] for k, v in runs.items() if v}, flush=True)
        finally:
            for p in spin:
                p.kill()
                p.wait()
    aborted = {k: sum(any(c != 0 for c in codes) for codes in v) for k, v in runs.items()}
    data = dict(
        command="python bench/gloo_exit.py " + " ".join(argv or sys.argv[1:]),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        runs=a.runs,
        runs_with_an_abort=aborted,
        exit_codes=runs,
        wall_s=time.time() - t0,
    )
    lines = [
        f"# gloo at exit: runs with a rank aborting ({data['command']}; {data['machine']})",
        "",
        "| script, busy processes beside | runs | runs with a rank exiting non-zero | exit codes seen |",
        "|---|---|---|---|",
    ]
    for k, v in runs.items():
        seen = sorted({c for codes in v for c in codes})
        lines.append(f"| {k} | {a.runs} | {aborted[k]} | {seen} |")
    write(os.path.join(HERE, "results", "gloo_exit"), data, lines)
    return 1 if any(n for k, n in aborted.items() if k.startswith("guard_exit")) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-main"]:
        rank_main(sys.argv[2] == "guard")
    else:
        sys.path.insert(0, HERE)
        raise SystemExit(main())
