"""Scaling study (predicted): attention time per layer at S = 128K and 1M for P = 8 .. 1024 on each hardware
preset, every strategy, with the regime marked.

    python bench/scaling.py [--out bench/results] [--pass both|fwd]

One attention layer, forward + backward (a training step's share), causal with zigzag load balance, bf16,
batch 1, d=128, for Llama-2-7B-like MHA (H = Hkv = 32) and Llama-3-8B-like GQA (H=32, Hkv=8). Presets grow
beyond one node by adding nodes over their stated inter-node fabric (see ``tokenring/sim/topology.py``).
Ulysses runs only where ``H % P == 0`` (P <= 32 here). Regime: *comm-bound* when the steps whose messages
outlast their computes make up most of the time, else *compute-bound*. Schedules for P = 1024 are built
once per strategy and pass (~1 min in all); the testbed kinds (CPU) are left out: 1M tokens on CPU cores is
not a configuration anyone runs.

Writes ``scaling_study.json``, ``scaling_study.md`` and ``scaling_study.png`` in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from tokenring.sim import candidates, get_topology, kernel_model, simulate  # noqa: E402
from tokenring.tools.simulate import HARDWARE_PRESETS, plot_curves, save_figure  # noqa: E402
from tokenring.sim.simulator import shapes_for  # noqa: E402

SEQS = [131072, 1048576]
PS = [8, 16, 32, 64, 128, 256, 512, 1024]
HEADS = {"MHA 32/32": (32, 32), "GQA 32/8": (32, 8)}


def run(presets, seqs, Ps, backward, log=print) -> list[dict]:
    rows = []
    for P in Ps:
        t0 = time.time()
        for preset in presets:
            topo = get_topology(preset, P)
            km = kernel_model(topo.device)
            for S in seqs:
                for label, (H, Hkv) in HEADS.items():
                    sh = shapes_for(S, P, H, Hkv, 128, 1, torch.bfloat16)
                    res = [simulate(n, sh, topo, km, causal=True, backward=backward)
                           for n in candidates(H, P, Hkv)]
                    best = min(r.time for r in res)
                    for r in res:
                        rows.append(dict(preset=preset, topology=topo.describe(), S=S, P=P, heads=label,
                                         strategy=r.strategy, time_s=r.time, compute_s=r.compute,
                                         exposed_comm_s=r.exposed_comm, regime=r.regime, vs_best=r.time / best,
                                         bytes_per_rank=sum(p.bytes_per_rank for p in r.passes)))
        log(f"P={P}: {time.time() - t0:.1f} s")
    return rows


def write(rows, out, backward):
    os.makedirs(out, exist_ok=True)
    meta = dict(what="predicted attention time per layer (one call" + (", forward+backward" if backward else
                ", forward") + "), causal zigzag, bf16, B=1, d=128", seqs=SEQS, Ps=PS, heads=HEADS)
    with open(os.path.join(out, "scaling_study.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = ["# Scaling study (predicted by tokenring.sim)", "",
             f"{meta['what']}. Regenerate: `python bench/scaling.py`. Each cell: time per layer, "
             f"**C** compute-bound / *m* comm-bound, and the best strategy in bold.", ""]
    strategies = ["token_ring", "ring", "ulysses"]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        for S in SEQS:
            for label in HEADS:
                sel = [r for r in rows if r["preset"] == preset and r["S"] == S and r["heads"] == label]
                if not sel:
                    continue
                lines += [f"## {preset}, S={S // 1024}K, {label}", "",
                          "| P | " + " | ".join(strategies) + " | best |", "|---" * (len(strategies) + 2) + "|"]
                for P in PS:
                    cells, best = [], ""
                    for st in strategies:
                        r = next((x for x in sel if x["P"] == P and x["strategy"] == st), None)
                        if r is None:
                            cells.append("-")
                            continue
                        txt = f"{_t(r['time_s'])} {'C' if r['regime'] == 'compute-bound' else 'm'}"
                        if r["vs_best"] == 1.0:
                            txt, best = f"**{txt}**", st
                        cells.append(txt)
                    if any(c != "-" for c in cells):
                        lines.append(f"| {P} | " + " | ".join(cells) + f" | {best} |")
                lines.append("")
    with open(os.path.join(out, "scaling_study.md"), "w") as f:
        f.write("\n".join(lines))
    _plot(rows, os.path.join(out, "scaling_study.png"), meta["what"])


def _t(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _plot(rows, path, what):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    cols = [(S, h) for S in SEQS for h in HEADS]
    fig, axes = plt.subplots(len(presets), len(cols), figsize=(3.6 * len(cols), 2.8 * len(presets)), squeeze=False)
    for i, preset in enumerate(presets):
        for j, (S, h) in enumerate(cols):
            ax = axes[i][j]
            plot_curves(ax, [r for r in rows if r["preset"] == preset and r["S"] == S and r["heads"] == h], "P")
            ax.set_title(f"{preset}, S={S // 1024}K, {h}", fontsize=8)
            if j == 0:
                ax.set_ylabel("ms / layer")
            if i == len(presets) - 1:
                ax.set_xlabel("P")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    save_figure(fig, path, what, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--pass", dest="mode", default="both", choices=["fwd", "both"])
    ap.add_argument("--presets", nargs="+", default=HARDWARE_PRESETS)
    ap.add_argument("--max-P", type=int, default=1024)
    a = ap.parse_args(argv)
    backward = a.mode == "both"
    rows = run(a.presets, SEQS, [p for p in PS if p <= a.max_P], backward)
    write(rows, a.out, backward)
    print(f"wrote {a.out}/scaling_study.{{json,md,png}} ({len(rows)} predictions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
