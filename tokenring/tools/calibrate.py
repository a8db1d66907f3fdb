"""``tokenring calibrate``: measure this machine's kernels and links and write a profile for ``auto``.

    tokenring calibrate --local-ranks 4 --out profile.json [--seq 16384 --heads 8 --kv-heads 2 --head-dim 128]
    torchrun --nproc-per-node 8 -m tokenring.tools.calibrate --out profile.json --dtype bfloat16
    TOKENRING_TOPOLOGY=profile.json python train.py        # or tokenring.set_topology("profile.json")
    tokenring explain --topology profile.json ...          # the measured figures next to the predictions

Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) every rank joins the group torchrun describes (NCCL when
CUDA devices are present, else gloo); otherwise ``--local-ranks P`` starts P local ranks (gloo on loopback, or
the links a testbed gives them). Rank 0 writes the profile. See :mod:`tokenring.calibration` for what is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from . import DTYPES

__all__ = ["main", "run_local"]


def _args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="tokenring-profile.json", help="where rank 0 writes the profile (JSON)")
    ap.add_argument("--local-ranks", "-P", type=int, default=None, help="start this many local ranks")
    ap.add_argument("--seq", type=int, default=None, help="global sequence length of the calls to come")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each measurement (fastest kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per local rank")
    ap.add_argument("--timeout", type=float, default=120.0, help="longest wait for a peer, seconds")


def _options(a) -> dict:
    return dict(
        seq=a.seq,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        dtype=a.dtype,
        repeats=a.repeats,
    )


def _run(options: dict, out: str | None):
    from .. import calibration as cal

    opts = dict(options, dtype=DTYPES[options["dtype"]])
    profile = cal.calibrate(**opts)
    import torch.distributed as dist

    if out and dist.get_rank() == 0:
        profile.save(out)
    return profile


def _worker(spec_path: str, rank: int) -> int:
    import torch.distributed as dist

    from .. import set_timeout
    from .launch import init_rank

    with open(spec_path) as f:
        spec = json.load(f)
    init_rank(rank, spec["P"], spec["store_dir"], threads=spec["threads"], timeout_s=spec["timeout"] + 60)
    try:
        set_timeout(spec["timeout"])
        _run(spec["options"], spec["result_path"] if rank == 0 else None)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def run_local(P: int, options: dict, *, threads: int = 1, timeout: float = 120.0, **launch_kw) -> dict:
    """Calibrate ``P`` fresh local ranks (``launch_kw``: a testbed's ``prefix`` / ``env``); the profile as a
    dict (rank 0's)."""
    from .bench import launch

    spec = dict(P=P, threads=threads, timeout=timeout, options=options)
    return launch(spec, timeout=timeout + 600, module="tokenring.tools.calibrate", **launch_kw)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"]:
        code = _worker(argv[1], int(argv[3]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as the bench worker: no interpreter teardown after the group is destroyed
    ap = argparse.ArgumentParser(prog="tokenring calibrate", description=__doc__.split("\n\n")[0])
    _args(ap)
    a = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        from .. import set_timeout

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        set_timeout(a.timeout)
        try:
            profile = _run(_options(a), a.out)
            if dist.get_rank() == 0:
                print(profile.summary())
                print(f"wrote {a.out}")
        finally:
            dist.destroy_process_group()
        return 0
    if not a.local_ranks or a.local_ranks < 2:
        ap.error("give --local-ranks P (P >= 2), or run it under torchrun")
    workdir = tempfile.mkdtemp(prefix="tokenring-calibrate-")
    try:
        data = run_local(a.local_ranks, _options(a), threads=a.threads, timeout=a.timeout, workdir=workdir)
    except RuntimeError as e:
        print(f"tokenring calibrate: {e}", file=sys.stderr)
        return 1
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
    from ..sim.topology import profile_summary, topology_from_dict

    print(profile_summary(topology_from_dict(data)))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
