#!/usr/bin/env python3
"""``layout="auto"``: how close its per-batch placement comes to the best one, what it gains over zigzag, and what
choosing costs per step.

    .venv/bin/python bench/auto_layout.py [--batches 8] [--long-batches 3] [--ranks 4 8 16]

The chooser (``tokenring.sim.placement``) times each placement on a reference layer (H=32, Hkv=8, d=128, bf16)
under five schedules (``tokenring.sim.placement.strategies``). It is judged here with each placement at the
fastest of every strategy variant ``strategy="auto"`` picks among (``variant_candidates``, 20-30 of them),
forward and backward, on its own layer and on three it did not look at (a 70B-class GQA layer, H=64 Hkv=8
d=128; a small MHA one, H=16 Hkv=16 d=64; an MQA one, H=32 Hkv=1 d=128), on the same topology
(h200-nvswitch-8, calibrated H200 kernels). Per batch and layer: auto's placement's time over the best
placement's (1.00 = it chose the best), with the chooser on its reference layer and told each layer
(``configure(layer=...)``). Batches: ``bench/balance.py``'s two mixes (log-normal lengths, median 600, sigma
1.6, 8192 tokens per rank; and one to three 32K-128K documents among them, 32768 per rank). Choice cost: the
wall time of ``resolve_layout`` on a batch not seen before (the answer is then cached per documents), on this
machine. Writes ``bench/results/auto_layout.{json,md}``.
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
sys.path.insert(0, HERE)

import _results  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from balance import documents, long_mix  # noqa: E402

import tokenring  # noqa: E402
from tokenring.layouts import padded_length, resolve_layout  # noqa: E402
from tokenring.masks import make_mask  # noqa: E402
from tokenring.schedules import Shapes  # noqa: E402
from tokenring.sim import get_topology, kernel_model, simulate  # noqa: E402
from tokenring.sim.kernel_model import block_flops  # noqa: E402
from tokenring.sim.placement import CANDIDATES  # noqa: E402
from tokenring.sim.simulator import variant_candidates  # noqa: E402

LAYERS = {
    "8B GQA (32/8, d=128), the chooser's": (32, 8, 128),
    "70B GQA (64/8, d=128)": (64, 8, 128),
    "MHA (16/16, d=64)": (16, 16, 64),
    "MQA (32/1, d=128)": (32, 1, 128),
}
WITHIN = 1.05


def layer_time(S: int, P: int, cu: list[int], layout: str, heads: tuple[int, int, int], topo, km) -> float:
    """The fastest forward+backward of any ``auto`` strategy variant for this placement and layer."""
    H, Hkv, d = heads
    Sp = padded_length(S, P, layout)
    docs = list(cu) + ([Sp] if Sp > S else [])
    mask = make_mask(Sp, docs, None, True, force=True)
    sh = Shapes(1, Sp // P, H, Hkv, d, torch.bfloat16, P)
    names = variant_candidates("auto", sh, True, layout)
    return min(simulate(n, sh, topo, km, causal=True, layout=layout, backward=True, mask=mask).time for n in names)


def bound(cu: list[int], P: int, heads: tuple[int, int, int], km) -> float:
    """A floor for any placement: every rank computes an even share of the batch's causal work (forward and
    backward) in one kernel call each way, with no message, merge or step overhead."""
    H, Hkv, d = heads
    share = {bwd: sum(block_flops(b - a, b - a, H, d, True, bwd) for a, b in zip(cu, cu[1:])) / P for bwd in (0, 1)}
    n = {bwd: int((f / block_flops(1, 1, H, d, True, bwd)) ** 0.5) for bwd, f in share.items()}
    return sum(km.block_time(n[b], n[b], H, Hkv, d, True, bool(b)) for b in (0, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--long-batches", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--per-rank", type=int, default=8192)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(11)
    km = kernel_model("h200", calibrated=True, dtype=torch.bfloat16)
    rows, data = [], []
    for mix, make, scale, n in (
        ("log-normal", documents, 1, a.batches),
        ("long documents", long_mix, 4, a.long_batches),
    ):
        for P in a.ranks:
            topo = get_topology("h200-nvswitch-8", P)
            S = a.per_rank * scale * P
            per = {name: [] for name in LAYERS}
            gain = {name: [] for name in LAYERS}
            known = {name: [] for name in LAYERS}
            over = {name: [] for name in LAYERS}
            costs, picks = [], []
            for _ in range(n):
                cu = make(S, rng)
                t0 = time.perf_counter()
                chose = resolve_layout("auto", S, P, cu)
                costs.append(time.perf_counter() - t0)
                picks.append(chose)
                for name, heads in LAYERS.items():
                    t = {lay: layer_time(S, P, cu, lay, heads, topo, km) for lay in CANDIDATES}
                    tokenring.configure(layer=heads)  # as SequenceParallelTrainer does from the model's config
                    told = resolve_layout("auto", S, P, cu)
                    tokenring.configure(layer=None)
                    floor = bound(cu, P, heads, km)
                    over[name].append((t["zigzag"] / floor, t[told] / floor))
                    per[name].append(t[chose] / min(t.values()))
                    known[name].append(t[told] / min(t.values()))
                    gain[name].append(t["zigzag"] / t[told])
                    data.append(
                        dict(
                            mix=mix,
                            P=P,
                            S=S,
                            layer=name,
                            cu_seqlens=cu,
                            auto=chose,
                            auto_told=told,
                            times_s=t,
                            bound_s=floor,
                        )
                    )
            for name in LAYERS:
                r, g, k = per[name], gain[name], known[name]
                ok, ok_k = sum(x <= WITHIN for x in r), sum(x <= WITHIN for x in k)
                rows.append(
                    f"| {mix} | {P} | {name} | {ok}/{len(r)} | {median(r):.3f} | {max(r):.3f} | "
                    f"{ok_k}/{len(k)} | {max(k):.3f} | "
                    f"{median(z for z, _ in over[name]):.2f} / {median(x for _, x in over[name]):.2f} | "
                    f"{median(g):.2f}x ({min(g):.2f}-{max(g):.2f}) | "
                    f"{', '.join(f'{c} {picks.count(c)}' for c in CANDIDATES if c in picks)} | "
                    f"{median(costs) * 1e3:.0f} ({min(costs) * 1e3:.0f}-{max(costs) * 1e3:.0f}) |"
                )
                print(rows[-1], flush=True)

    def share(name, key="auto"):
        cases = [x for x in data if x["layer"] == name]
        ok = sum(x["times_s"][x[key]] <= WITHIN * min(x["times_s"].values()) for x in cases)
        return f"{ok}/{len(cases)} ({100 * ok / len(cases):.0f}%)"

    lines = [
        "# layout='auto': its placement against the best one, per batch",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. "
        f"Command: `{' '.join(['.venv/bin/python bench/auto_layout.py', *(argv or sys.argv[1:])])}`.",
        "",
        "The chooser times each placement on a reference layer (H=32, Hkv=8, d=128) under seven schedules (ring "
        "and TokenRing relayed, direct to half the peers and to all, Ulysses); it is judged with each placement "
        "at the fastest of every strategy variant `auto` picks among, on its own layer and three others, "
        "forward+backward, causal, "
        "h200-nvswitch-8 (calibrated H200 kernels, bf16). "
        f"Within 5%: batches where auto's placement is at most {WITHIN:.2f}x the best placement's time. Ratio: "
        "auto's time over the best (1.000: the best). Vs zigzag: zigzag's time over auto's (told the layer), "
        "median (min-max). Floor: every rank computing an even share of the batch's causal work in one kernel "
        "call each way, nothing else (no message, merge or step); zigzag's and auto's times over it, medians. "
        "Choice cost: resolve_layout on a new batch, on this machine, median (min-max) ms (then cached).",
        "",
        "Batches within 5% of the best placement, over the whole grid: "
        + "; ".join(
            f"{'**' if i == 0 else ''}{name}: {share(name)}{'**' if i == 0 else ''}" for i, name in enumerate(LAYERS)
        )
        + ".",
        "",
        "Told the layer (`tokenring.configure(layer=...)`, which `SequenceParallelTrainer` sets from the model's "
        "config): " + "; ".join(f"{name}: {share(name, 'auto_told')}" for name in LAYERS) + ".",
        "",
        "| mix | P | layer | within 5% | ratio median | ratio worst | told the layer: within 5% | told: worst | "
        "zigzag / auto (told) over the floor | vs zigzag (told) | auto chose (untold) | choice cost ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    _results.write(os.path.join(HERE, "results", "auto_layout"), {"within": WITHIN, "cases": data}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
