#!/usr/bin/env python3
"""Load balance of packed batches: the causal attention work each rank computes under ``layout="zigzag"`` (the
default), ``"contiguous"``, ``"balanced"`` (chunks dealt out by work, ``tokenring.layouts.balanced_plan``) and
``"whole_docs"`` (documents whole on one rank, long ones split, ``whole_docs_plan``), and what it does to a call.

    .venv/bin/python bench/balance.py [--batches 20] [--per-rank 8192] [--ranks 4 8 16] [--time-ranks 4]

Documents: lengths drawn from a log-normal with median 600 tokens and sigma 1.6 (a long tail: about 1 in 10
over 4K), rounded and clipped to [1, 16384], packed into batches of ``per-rank x P`` tokens, the last document
cut at the end (as a packing collator fills a fixed budget); and a mix of one to three 32K-128K documents among
such short ones (4x the tokens per rank). Work, per rank, counted from the schedule a call runs (its tiles): the
query-key pairs the kernels compute, a masked tile counted whole, since its kernel computes every pair. ``ring``
computes where the queries live, ``token_ring`` where the keys live. Reported: max / mean over ranks (1.00 =
perfect), the median and worst over the batches; the simulator's prediction of a forward+backward call on an
H200 NVSwitch node (``h200-nvswitch-8``, calibrated H200 kernel model, bf16), also for one document filling the
batch.

Time: ``--time-ranks`` gloo ranks on this machine, forward+backward per call, B=1, H=8, Hkv=2, d=64, float32,
zigzag, contiguous and balanced interleaved per batch, every call kept (``bench/placement.py`` times whole_docs,
also on the emulated mesh). Writes ``bench/results/balance.{json,md}``.
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
import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYOUTS = ("zigzag", "contiguous", "balanced", "whole_docs")
TIMED = ("zigzag", "contiguous", "balanced")  # measured here on gloo (bench/placement.py measures whole_docs)
STRATEGIES = ("ring", "token_ring")


def documents(S: int, rng: np.random.Generator) -> list[int]:
    """``cu_seqlens`` of one packed batch of ``S`` tokens (log-normal lengths, median 600, sigma 1.6, 1..16384)."""
    cu = [0]
    while cu[-1] < S:
        n = int(np.clip(np.round(rng.lognormal(np.log(600), 1.6)), 1, 16384))
        cu.append(min(S, cu[-1] + n))
    return cu


def long_mix(S: int, rng: np.random.Generator) -> list[int]:
    """``cu_seqlens`` of a batch of ``S`` tokens: one to three documents of 32K-128K tokens (at most half of
    ``S`` together) among log-normal short ones, in random order."""
    longs = []
    for _ in range(int(rng.integers(1, 4))):
        n = int(rng.integers(32768, 131073))
        if sum(longs) + n <= S // 2:
            longs.append(n)
    rest = np.diff(documents(S - sum(longs), rng)).tolist()
    lengths = longs + rest
    rng.shuffle(lengths)
    return [0, *np.cumsum(lengths).tolist()]


def work(S: int, P: int, cu: list[int], layout: str, strategy: str) -> list[int]:
    """Query-key pairs each rank's kernels compute in a causal forward (masked tiles counted whole)."""
    from tokenring.masks import make_mask, shard_tiles
    from tokenring.schedules import part_slice
    from tokenring.strategies import get

    mask = make_mask(S, cu, None, True, force=True)
    s, done = S // P, [0] * P
    name = "token_ring:relay" if strategy == "token_ring" else strategy
    for st in get(name).schedule(P, layout, True, False, mask).steps:
        for c in st.computes:
            qs, ks = part_slice(c.q_part, s), part_slice(c.kv_part, s)
            for t in shard_tiles(mask, P, layout, c.q_owner, (qs.start, qs.stop), c.kv_owner, (ks.start, ks.stop)):
                n, m = t.q1 - t.q0, t.k1 - t.k0
                done[c.rank] += n * (n + 1) // 2 if t.kind == "causal" else n * m
    return done


def imbalance(per_rank: list[int]) -> float:
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def rank_fn(rank: int, P: int, S: int, cu: list[int], layout: str, strategy: str, calls: int) -> list[float]:
    """Per call, the slowest rank's forward+backward wall time (after a barrier); the first call is a warm-up."""
    import torch.distributed as dist

    import tokenring

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, S, h, 64, generator=g) for h in (8, 2, 2, 8)]
    local = [tokenring.shard(t, 1, layout, cu_seqlens=cu) for t in full]
    times = []
    for i in range(calls + 1):
        q, k, v = (t.clone().requires_grad_() for t in local[:3])
        dist.barrier()
        t0 = time.perf_counter()
        out = tokenring.attention(q, k, v, causal=True, layout=layout, strategy=strategy, cu_seqlens=cu)
        out.backward(local[3])
        slow = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        if i:
            times.append(slow.item())
    return times


def predicted(S: int, P: int, cu: list[int], layout: str, strategy: str) -> float:
    """The simulator's forward+backward time on an H200 NVSwitch node (bf16, an 8B model's layer: H=32, Hkv=8,
    d=128)."""
    from tokenring.masks import make_mask
    from tokenring.schedules import Shapes
    from tokenring.sim import get_topology, kernel_model, simulate

    topo = get_topology("h200-nvswitch-8", P)
    sh = Shapes(1, S // P, 32, 8, 128, torch.bfloat16, P)
    mask = make_mask(S, cu, None, True, force=True)
    kern = kernel_model("h200", calibrated=True, dtype=torch.bfloat16)
    return simulate(strategy, sh, topo, kern, causal=True, layout=layout, backward=True, mask=mask).time


MIXES = {
    "log-normal": (documents, 1),  # (cu_seqlens of a batch, tokens per rank in units of --per-rank)
    "long documents": (long_mix, 4),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--per-rank", type=int, default=8192)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--time-ranks", type=int, default=4)
    ap.add_argument("--time-per-rank", type=int, default=4096)
    ap.add_argument("--time-batches", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--predict-batches", type=int, default=3)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows, data = [], {"balance": [], "time": [], "single": []}
    for mix, (make, scale) in MIXES.items():
        for P in a.ranks:
            S = a.per_rank * scale * P
            got = {(lay, st): [] for lay in LAYOUTS for st in STRATEGIES}
            pred = {(lay, st): [] for lay in LAYOUTS for st in STRATEGIES}
            nbatches = a.batches if mix == "log-normal" else a.predict_batches
            for n in range(nbatches):
                cu = make(S, rng)
                for lay in LAYOUTS:
                    for st in STRATEGIES:
                        w = work(S, P, cu, lay, st)
                        got[lay, st].append(imbalance(w))
                        t = predicted(S, P, cu, lay, st) if n < a.predict_batches else None
                        if t is not None:
                            pred[lay, st].append(t)
                        data["balance"].append(
                            dict(mix=mix, P=P, S=S, documents=len(cu) - 1, layout=lay, strategy=st, work=w,
                                 predicted_s=t, cu_seqlens=cu if n < a.predict_batches else None)
                        )  # fmt: skip
            for (lay, st), xs in got.items():
                ratio = [z / x for x, z in zip(pred[lay, st], pred["zigzag", st])]
                rows.append(
                    f"| {mix} | {P} | {S} | {lay} | {st} | {median(xs):.3f} | {max(xs):.3f} | "
                    f"{median(pred[lay, st]) * 1e3:.1f} | {median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) |"
                )
    single = []
    for P in a.ranks:
        S = a.per_rank * P
        for st in STRATEGIES:
            t = {lay: predicted(S, P, [0, S], lay, st) for lay in ("zigzag", "whole_docs")}
            data["single"].append(dict(P=P, S=S, strategy=st, predicted_s=t))
            single.append(
                f"| {P} | {S} | {st} | {t['zigzag'] * 1e3:.2f} | {t['whole_docs'] * 1e3:.2f} | "
                f"{t['whole_docs'] / t['zigzag']:.3f} |"
            )
    lines = [
        "# Load balance of packed batches: zigzag, contiguous, balanced and whole_docs",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. "
        f"Command: `{' '.join(['.venv/bin/python bench/balance.py', *(argv or sys.argv[1:])])}`.",
        "",
        f"Mixes: *log-normal*: lengths (median 600, sigma 1.6) clipped to [1, 16384], packed into {a.per_rank} "
        f"tokens per rank, {a.batches} batches per P; *long documents*: one to three documents of 32K-128K tokens "
        f"(at most half the batch) among log-normal ones, {4 * a.per_rank} tokens per rank, {a.predict_batches} "
        f"batches per P. Imbalance: causal forward work of the busiest rank over the mean, as the kernels "
        f"compute it (masked tiles whole). Predicted: the simulator's forward+backward time of one attention "
        f"call, the first {a.predict_batches} batches, on h200-nvswitch-8 (calibrated H200 kernels, bf16, H=32, "
        f"Hkv=8, d=128): median ms, and zigzag's time over the layout's on the same batch (above 1: faster than "
        f"zigzag), median (min-max).",
        "",
        "| mix | P | S | layout | strategy (computes at) | imbalance median | imbalance worst | predicted ms | "
        "speed-up vs zigzag |",
        "|---|---|---|---|---|---|---|---|---|",
        *[r.replace("| ring |", "| ring (queries) |").replace("| token_ring |", "| token_ring (keys) |") for r in rows],
        "",
        "## One document filling the batch",
        "",
        "whole_docs splits it over every rank, zigzag within it: the same placement as zigzag. Predicted "
        "forward+backward ms, same model.",
        "",
        "| P | S | strategy | zigzag ms | whole_docs ms | whole_docs / zigzag |",
        "|---|---|---|---|---|---|",
        *single,
    ]
    lines += _timing(a, rng, data)
    _results.write(os.path.join(HERE, "results", "balance"), data, lines)
    return 0


def _timing(a, rng, data) -> list[str]:
    """Measured (gloo ranks here) and predicted (H200 node) forward+backward time, zigzag vs balanced."""
    from tokenring.tools.launch import RankPool

    P, S = a.time_ranks, a.time_per_rank * a.time_ranks
    out = [
        "",
        f"## A call's time, P={P}, S={S}, causal, forward+backward",
        "",
        f"Measured: {P} gloo ranks on this machine (1 thread each; {os.cpu_count()} cores, so ranks share "
        f"cores and the time follows the total work more than the busiest rank's), B=1, H=8, Hkv=2, d=64, "
        f"float32; {a.calls} rounds, each layout once per round after a warm-up call: median [min-max] seconds.",
        "",
        "| batch | documents | strategy | zigzag s | contiguous s | balanced s | balanced / zigzag |",
        "|---|---|---|---|---|---|---|",
    ]
    with RankPool(P) as pool:
        for b in range(a.time_batches):
            cu = documents(S, rng)
            for st in STRATEGIES:
                t = {lay: [] for lay in TIMED}
                for _ in range(a.calls):  # the layouts interleaved, one timed call each per round
                    for lay in TIMED:
                        t[lay] += pool.run(rank_fn, S, cu, lay, st, 1)[0]
                data["time"].append(dict(P=P, S=S, cu_seqlens=cu, strategy=st, measured=t))
                span = {lay: f"{median(x):.3f} [{min(x):.3f}-{max(x):.3f}]" for lay, x in t.items()}
                out.append(
                    f"| {b} | {len(cu) - 1} | {st} | {span['zigzag']} | {span['contiguous']} | {span['balanced']} | "
                    f"{median(t['balanced']) / median(t['zigzag']):.2f} |"
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
