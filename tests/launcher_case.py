"""A silent peer under launchers people write themselves: a plain ``init_process_group`` per process
(MASTER_ADDR/PORT) and ``torch.multiprocessing.spawn``, where rank 0's process hosts torch's TCP store, and
torchrun, whose agent hosts it. Each rank runs ``cases.silent_case`` (rank 2 stops before its first call, before
a later one, or dies) and ends with ``destroy_process_group()``, as the tutorials' scripts do. Each surviving rank
writes ``<out>/<rank>.json``: [seconds from its failed call to its RuntimeError, the message].

    unshare -n sh -c 'ip link set lo up && exec python tests/launcher_case.py plain ring later 1.5 OUT'

Run it in a fresh network namespace (the test and bench/silent_peer.py do): the TCP store listens on every
interface, and there only loopback exists.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cases, also in mp.spawn's children

P, VICTIM = 4, 2


def rank_main(rank: int, port: int, strategy: str, when: str, timeout: float, out: str) -> None:
    import cases
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))  # (torchrun sets both: its agent hosts the store)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", rank=rank, world_size=P)
    result = cases.silent_case(rank, P, strategy, VICTIM, when, timeout)
    if result is not None:
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()  # the tutorials' cleanup()


def _mp_entry(rank: int, *args) -> None:
    rank_main(rank, *args)


def main(launcher: str, strategy: str, when: str, timeout: str, out: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (port, strategy, when, float(timeout), out)
    if launcher == "plain":
        here = os.path.abspath(__file__)
        procs = [subprocess.Popen([sys.executable, here, "rank", str(r), *map(str, args)]) for r in range(P)]
        codes = [p.wait(timeout=120) for p in procs]
    elif launcher == "torchrun":
        run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={P}", "--master-addr=127.0.0.1"]
        here = os.path.abspath(__file__)
        codes = [subprocess.run([*run, f"--master-port={port}", here, "rank", "env", *map(str, args)]).returncode]
    elif launcher == "mp_spawn":
        import torch.multiprocessing as mp

        mp.spawn(_mp_entry, args=args, nprocs=P, join=True)
        codes = [0] * P
    else:
        raise SystemExit(f"unknown launcher {launcher!r}: plain, torchrun or mp_spawn")
    raise SystemExit(max(codes))


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        r, port, strategy, when, timeout, out = sys.argv[2:]
        rank_main(int(os.environ["RANK"] if r == "env" else r), int(port), strategy, when, float(timeout), out)
    else:
        main(*sys.argv[1:])
