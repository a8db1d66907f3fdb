#!/usr/bin/env python3
"""Packed batches placed four ways (``zigzag``, ``contiguous``, ``balanced``, ``whole_docs``) and as ``auto``
chooses per batch (for the topology each part runs on, ``$TOKENRING_TOPOLOGY``: ``loopback`` for the unshaped
ranks, the testbed's own for the mesh): the time of a forward+backward call, on unshaped local ranks and on the
emulated mesh at its comm-bound rate, with the bytes every call moves and the causal work of the busiest rank.

    sudo .venv/bin/python bench/placement.py [--ranks 4] [--per-rank 2048] [--batches 3] [--rounds 5]

Documents: log-normal lengths (median 600, sigma 1.6, as ``bench/balance.py``) packed into ``per-rank x P``
tokens, the last one cut at the end. B=1, H=Hkv=8, d=64, float32, causal, one torch thread per rank. Every round
runs one call of each layout (the order rotated per round), so round i of two layouts is a pair; every call is
kept. The comm-bound rate is measured first, on the unshaped ranks: the rate at which the K/V of one rank's
shard (what ring moves per step) takes twice the forward of a rank's own causal block of the same rows
(``bench/token_ring_wins.py``'s definition). Each layout's outputs and gradients, gathered, are compared with
zigzag's (float32). Writes ``bench/results/placement.{json,md}``; the mesh part needs root (the testbed).
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
sys.path.insert(0, HERE)

import _results  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from balance import LAYOUTS as PLACED  # noqa: E402
from balance import documents  # noqa: E402

from tokenring.layouts import PLANNED_LAYOUTS  # noqa: E402

STRATEGIES = ("token_ring", "ring", "auto")
LAYOUTS = (*PLACED, "auto")
BY_DOCS = (*PLANNED_LAYOUTS, "auto")  # the layouts that take the documents to place the tokens
H, HKV, D = 8, 8, 64


def busiest(S: int, P: int, cu: list[int], layout: str) -> float:
    """Causal query-key pairs of the busiest rank over the mean (1.00: even), counted exactly."""
    from tokenring.layouts import local_positions

    b = torch.tensor(cu)
    work = []
    for r in range(P):
        pos = local_positions(S, P, r, layout, cu_seqlens=cu if layout in BY_DOCS else None)
        work.append(float((pos - b[torch.searchsorted(b, pos, right=True) - 1] + 1).sum()))
    return max(work) / (sum(work) / P)


# ------------------------------------------------------------------------------------------------ rank side
def _call(tokenring, full, cu, layout, strategy):
    """One timed forward+backward on this rank: (seconds, bytes sent, outputs)."""
    import torch.distributed as dist

    from tokenring.instrument import instrument

    docs = cu if layout in BY_DOCS else None
    local = [tokenring.shard(t, 1, layout, cu_seqlens=docs) for t in full]
    q, k, v = (t.clone().requires_grad_() for t in local[:3])
    log: list = []
    dist.barrier()
    t0 = time.perf_counter()
    with instrument(comm_log=log):
        out = tokenring.attention(q, k, v, causal=True, layout=layout, strategy=strategy, cu_seqlens=cu)
        out.backward(local[3])
    dt = time.perf_counter() - t0
    sent = sum(rec["bytes"] for _, recs in log for rec in recs if rec["direction"] == "send")
    return dt, sent, [out.detach(), q.grad, k.grad, v.grad], docs


def _worker(spec_path: str, rank: int) -> int:
    import torch.distributed as dist

    import tokenring
    from tokenring.tools.launch import init_rank

    with open(spec_path) as f:
        spec = json.load(f)
    P = spec["P"]
    init_rank(rank, P, spec["store_dir"], threads=1, timeout_s=spec["timeout"])
    tokenring.set_timeout(spec["timeout"])
    out: dict = {"calls": [], "errors": []}
    try:
        s = spec["per_rank"]
        if spec.get("calibrate"):  # one rank's own causal block, all ranks at once (they share the cores)
            x = torch.randn(1, H, s, D)
            ts = []
            for _ in range(5):
                dist.barrier()
                t0 = time.perf_counter()
                torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
                ts.append(time.perf_counter() - t0)
            slow = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            out["block_s"] = median(slow.tolist()[1:])
        from tokenring.layouts import resolve_layout

        out["auto"] = [resolve_layout("auto", cu[-1], P, cu) for cu in spec["batches"]]
        for b, cu in enumerate(spec["batches"]):
            S = cu[-1]
            g = torch.Generator().manual_seed(b)
            full = [torch.randn(1, S, h, D, generator=g) for h in (H, HKV, HKV, H)]
            for st in spec["strategies"]:
                ref = None
                for rnd in range(spec["rounds"] + 1):  # round 0: a checked warm-up
                    shift = rnd % len(LAYOUTS)
                    for lay in LAYOUTS[shift:] + LAYOUTS[:shift]:
                        dt, sent, outs, docs = _call(tokenring, full, cu, lay, st)
                        stat = torch.tensor([dt, float(sent)], dtype=torch.float64)
                        top = stat.clone()
                        dist.all_reduce(top, op=dist.ReduceOp.MAX)
                        dist.all_reduce(stat, op=dist.ReduceOp.SUM)
                        if rnd == 0:
                            got = [tokenring.gather(t.contiguous(), 1, lay, cu_seqlens=docs) for t in outs]
                            if lay == "zigzag":
                                ref = got
                            else:
                                err = max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(got, ref))
                                out["errors"].append(dict(batch=b, strategy=st, layout=lay, err=err))
                            continue
                        out["calls"].append(
                            dict(batch=b, strategy=st, layout=lay, round=rnd, seconds=top[0].item(),
                                 bytes=stat[1].item())
                        )  # fmt: skip
        if rank == 0:
            with open(spec["result_path"], "w") as f:
                json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ driver side
def _run(spec: dict, **launch_kw) -> dict:
    from tokenring.tools.bench import launch

    extra = launch_kw.pop("env", None)
    # the chooser of layout="auto" told this bench's layer, as SequenceParallelTrainer tells it a model's
    env = lambda r: {**(extra(r) if extra else {}), "PYTHONPATH": HERE, "TOKENRING_LAYER": f"{H},{HKV},{D}"}  # noqa: E731
    spec = dict(spec, threads=1)
    return launch(spec, env=env, module="placement", timeout=spec["timeout"] * 4, **launch_kw)


def _table(res: dict, batches: list, P: int, title: str) -> list[str]:
    lines = [
        "",
        f"## {title}",
        "",
        "| batch | documents | strategy | layout | busiest / mean work | ms per call, median [min-max] | "
        "vs zigzag (median of paired rounds) | MB moved per call (all ranks) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b, cu in enumerate(batches):
        S = cu[-1]
        for st in STRATEGIES:
            calls = [c for c in res["calls"] if c["batch"] == b and c["strategy"] == st]
            t = {lay: {c["round"]: c["seconds"] for c in calls if c["layout"] == lay} for lay in LAYOUTS}
            for lay in LAYOUTS:
                placed = res["auto"][b] if lay == "auto" else lay
                xs = list(t[lay].values())
                pairs = [t["zigzag"][r] / t[lay][r] for r in t[lay]]
                mb = median(c["bytes"] for c in calls if c["layout"] == lay) / 1e6
                lines.append(
                    f"| {b} | {len(cu) - 1} | {st} | {lay if lay != 'auto' else f'auto: {placed}'} | "
                    f"{busiest(S, P, cu, placed):.2f} | "
                    f"{median(xs) * 1e3:.0f} [{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}] | "
                    f"{median(pairs):.2f}x ({sum(p > 1 for p in pairs)}/{len(pairs)} faster) | {mb:.2f} |"
                )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--per-rank", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--_worker")
    ap.add_argument("--_rank", type=int)
    a = ap.parse_args(argv)
    if a._worker:
        return _worker(a._worker, a._rank)
    from tokenring.tools import testbed

    P = a.ranks
    rng = np.random.default_rng(0)
    batches = [documents(a.per_rank * P, rng) for _ in range(a.batches)]
    spec = dict(P=P, per_rank=a.per_rank, batches=batches, rounds=a.rounds, strategies=list(STRATEGIES),
                timeout=a.timeout, calibrate=True)  # fmt: skip
    free = _run(spec, env=lambda r: {"TOKENRING_TOPOLOGY": "loopback"})
    block = free["block_s"]
    kv = 2 * a.per_rank * HKV * D * 4
    rate = max(10, round(kv * 8 / (2 * block) / 1e6 / 10) * 10)
    data = dict(spec=spec, unshaped=free, rate_mbit=rate, kv_bytes=kv, block_s=block)
    why = testbed.available()
    if why is None:
        with testbed.Testbed(P, "mesh", rate) as tb:
            data["mesh"] = _run(dict(spec, calibrate=False), **tb.launch_kwargs())  # (its topology for auto)
            data["testbed"] = dict(tb.describe(), dropped=tb.dropped())
    worst = max((e["err"] for e in free["errors"] + data.get("mesh", {}).get("errors", [])), default=0.0)
    cmd = " ".join(["sudo .venv/bin/python bench/placement.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        "# Packed batches: four placements and auto's on unshaped ranks and on the emulated mesh",
        "",
        f"Command: `{cmd}`. Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {P} gloo ranks of 1 thread (sharing the cores). Shapes: {a.per_rank} tokens "
        f"per rank, B=1, H=Hkv={H}, d={D}, float32, causal, forward+backward per call. Documents: log-normal "
        f"lengths (median 600, sigma 1.6). {a.rounds} rounds after a checked warm-up, the layouts' order rotated "
        f"per round; every call in the JSON. Busiest / mean: causal query-key pairs of the busiest rank over the "
        f"mean. MB moved: bytes every rank sent in one call, summed. Largest difference of a layout's gathered "
        f"outputs and gradients from zigzag's: {worst:.1e} (relative to the largest value).",
        "",
        f"Comm-bound rate: a rank's own causal {a.per_rank}-row forward took {block * 1e3:.1f} ms (all ranks at "
        f"once); its K/V ({kv / 1e6:.2f} MB) takes twice that at {rate} Mbit/s per link direction.",
    ]
    lines += _table(free, batches, P, "Unshaped local ranks (compute-bound here)")
    if "mesh" in data:
        lines += _table(data["mesh"], batches, P, f"Mesh at the comm-bound rate, {rate} Mbit/s per link direction")
    else:
        lines += ["", f"Mesh: not run ({why})."]
    _results.write(os.path.join(HERE, "results", "placement"), data, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
