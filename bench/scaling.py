"""Scaling study (predicted): attention time per layer and parallel efficiency at S = 128K and 1M for P = 8 ..
1024 on every hardware preset, flat and hierarchical strategies, with the compute floor.

    python bench/scaling.py [--out bench/results] [--max-P 1024]

One attention layer, causal with zigzag load balance, bf16, batch 1, d=128, forward+backward (a training
step's share) for Llama-2-7B-like MHA (H = Hkv = 32), Llama-3-8B-like GQA (32/8) and Llama-3-405B-like GQA
(128/8), and forward only (prefill) for the last. From P = 512 on only S = 1M (S = 128K would leave 256 tokens
or fewer per GPU); every schedule there has ~P^2 blocks and the whole study takes about half an hour. Presets grow
beyond one node by adding nodes over their stated inter-node
fabric (see ``tokenring/sim/topology.py``): one NIC per GPU. Candidates per cell: the flat families (each
simulated as its best variant; Ulysses only where ``H % P == 0``) and, beyond one node, the hierarchical ones
(``usp``, ``double_ring``, ``token_ring_2d``) over nodes of the preset's node size (and its divisors up to 64
ranks).

Per cell: the best strategy, its time, its *parallel efficiency* ``E = T1 / (P x time)`` where ``T1`` is the
kernel model's time for the whole sequence on one GPU (one causal kernel call), and its *compute share*
(its busiest rank's compute / time: 1.0 = every byte hidden). ``E`` can exceed 1: one GPU would run the
whole triangle as one causal kernel, which the H200 measurements make slower per FLOP than the rectangles a
zigzag schedule computes (the compute floor line ``T1 / P`` is drawn for that reason).

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
from tokenring.sim.auto import node_sizes  # noqa: E402
from tokenring.sim.simulator import compile_schedule, shapes_for  # noqa: E402
from tokenring.strategies import HIERARCHICAL, get  # noqa: E402
from tokenring.strategies.base import _cached_schedule  # noqa: E402
from tokenring.tools.simulate import HARDWARE_PRESETS, save_figure  # noqa: E402

SEQS = [131072, 1048576]
PS = [8, 16, 32, 64, 128, 256, 512, 1024]
HEADS = {"MHA 32/32": (32, 32), "GQA 32/8": (32, 8), "GQA 128/8": (128, 8)}
PASSES = {"fwd+bwd": True, "fwd": False}
PREFILL_HEADS = ("GQA 128/8",)  # forward-only (prefill) cells: the goal's heads (every cell costs P^2 blocks)
LONG_ONLY_FROM = 512  # from this P on, only S = 1M (128K over 512+ GPUs is 256 tokens or fewer per GPU)
GOAL = dict(preset="h100-nvswitch-8", S=1048576, P=128, heads="GQA 128/8")  # 16 nodes x 8 H100, 400 Gb/s/GPU


def one_gpu(km, S: int, H: int, Hkv: int, backward: bool) -> float:
    """The whole sequence on one GPU: one causal kernel call (forward, and backward if asked)."""
    t = km.block_time(S, S, H, Hkv, 128, True, False, 2)
    return t + (km.block_time(S, S, H, Hkv, 128, True, True, 2) if backward else 0.0)


def strategies(topo, H: int, Hkv: int, P: int) -> list[str]:
    flat = candidates(H, P, Hkv)
    sizes = node_sizes(topo, P)
    if P > 64 and sizes:  # every schedule here has ~P^2 blocks: keep the node's own size only
        sizes = sizes[-1:]
    hier = [get(f).with_inner(n).name for n in sizes for f in HIERARCHICAL]
    return flat + [h for h in hier if get(h).check(H, Hkv, P) is None]


def run(presets, seqs, Ps, log=print, partial: str | None = None) -> list[dict]:
    rows = []
    for P in Ps:
        t0 = time.time()
        for preset in presets:
            topo = get_topology(preset, P)
            km = kernel_model(topo.device)
            for S in seqs:
                if P >= LONG_ONLY_FROM and S < max(seqs):
                    continue
                for label, (H, Hkv) in HEADS.items():
                    sh = shapes_for(S, P, H, Hkv, 128, 1, torch.bfloat16)
                    for pname, backward in PASSES.items():
                        if not backward and label not in PREFILL_HEADS:
                            continue
                        t1 = one_gpu(km, S, H, Hkv, backward)
                        for name in strategies(topo, H, Hkv, P):
                            r = simulate(name, sh, topo, km, causal=True, backward=backward)
                            _cached_schedule.cache_clear()  # compiled arrays are kept; 1M-block objects are not
                            rows.append(
                                dict(
                                    preset=preset,
                                    topology=topo.describe(),
                                    S=S,
                                    P=P,
                                    heads=label,
                                    pass_=pname,
                                    strategy=name,
                                    variant=r.strategy,
                                    hierarchical=get(name).hierarchical,
                                    time_s=r.time,
                                    compute_s=r.compute,
                                    exposed_comm_s=r.exposed_comm,
                                    regime=r.regime,
                                    one_gpu_s=t1,
                                    efficiency=t1 / (P * r.time),
                                    compute_share=r.compute / r.time,
                                    bytes_per_rank=sum(p.bytes_per_rank for p in r.passes),
                                )
                            )
        log(f"P={P}: {time.time() - t0:.1f} s")
        compile_schedule.cache_clear()
        if partial:  # a crash (memory, time) keeps the groups done so far
            with open(partial, "w") as f:
                json.dump(rows, f)
    return rows


def best(rows, hierarchical=None):
    sel = [r for r in rows if hierarchical is None or r["hierarchical"] == hierarchical]
    return min(sel, key=lambda r: r["time_s"]) if sel else None


def cells(rows):
    """(preset, S, heads, pass) -> P -> the rows of that cell."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["preset"], r["S"], r["heads"], r["pass_"]), {}).setdefault(r["P"], []).append(r)
    return out


def _t(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def write(rows, out):
    os.makedirs(out, exist_ok=True)
    meta = dict(
        what="predicted attention time per layer (one call), causal zigzag, bf16, B=1, d=128",
        seqs=SEQS,
        Ps=PS,
        heads=HEADS,
        passes=list(PASSES),
        goal=GOAL,
        efficiency="one GPU's time for the whole sequence (one causal kernel) / (P x time)",
    )
    with open(os.path.join(out, "scaling_study.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    table = cells(rows)
    L = [
        "# Scaling study (predicted by tokenring.sim)",
        "",
        f"{meta['what']}; forward+backward and forward only. Regenerate: `python bench/scaling.py`. "
        "Efficiency E = one GPU's time for the whole sequence / (P x time); compute share = the busiest rank's "
        "compute / time (1.0: communication fully hidden). E above 1 means the distributed blocks run faster "
        "per FLOP than one causal kernel over the whole sequence does (H200-measured kernel curves).",
        "",
    ]
    # the goal first
    L += ["## Goal: S=1M, P=128 (16 nodes x 8 H100, 400 Gb/s IB per GPU), causal GQA 128/8, d=128", ""]
    for pname in PASSES:
        cell = table.get((GOAL["preset"], GOAL["S"], GOAL["heads"], pname), {})
        if GOAL["P"] in cell:
            b = best(cell[GOAL["P"]])
            low = [P for P in sorted(cell) if best(cell[P])["efficiency"] < 0.95]
            L.append(
                f"- {pname}: best `{b['variant']}` {_t(b['time_s'])}, efficiency **{b['efficiency']:.3f}**, "
                f"compute share {b['compute_share']:.3f}; best flat `{best(cell[GOAL['P']], False)['variant']}` "
                f"efficiency {best(cell[GOAL['P']], False)['efficiency']:.3f}. Efficiency below 95% from P = "
                f"{low[0] if low else 'never (up to ' + str(max(cell)) + ')'}."
            )
    L.append("")
    for (preset, S, heads, pname), byP in table.items():
        L += [
            f"## {preset}, S={S // 1024}K, {heads}, {pname}",
            "",
            "| P | best flat | E | best hierarchical | E | best | E | compute share | regime |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for P in sorted(byP):
            f, h, b = best(byP[P], False), best(byP[P], True), best(byP[P])
            hcell = f"`{h['variant']}` {_t(h['time_s'])} | {h['efficiency']:.2f}" if h else "- | -"
            L.append(
                f"| {P} | `{f['variant']}` {_t(f['time_s'])} | {f['efficiency']:.2f} | {hcell} | "
                f"{'hier.' if b['hierarchical'] else 'flat'} | **{b['efficiency']:.2f}** | "
                f"{b['compute_share']:.2f} | {b['regime']} |"
            )
        L.append("")
    with open(os.path.join(out, "scaling_study.md"), "w") as f:
        f.write("\n".join(L))
    _plot(table, os.path.join(out, "scaling_study.png"), meta["what"])


def _plot(table, path, what):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(k[0] for k in table))
    cols = [(S, h) for S in SEQS for h in HEADS]
    fig, axes = plt.subplots(len(presets), len(cols), figsize=(3.3 * len(cols), 2.7 * len(presets)), squeeze=False)
    for i, preset in enumerate(presets):
        for j, (S, h) in enumerate(cols):
            ax = axes[i][j]
            byP = table.get((preset, S, h, "fwd+bwd"), {})
            Ps = sorted(byP)
            if not Ps:
                ax.set_visible(False)
                continue
            for hier, color, name in ((False, "tab:blue", "best flat"), (True, "tab:red", "best hierarchical")):
                pts = [(P, best(byP[P], hier)) for P in Ps if best(byP[P], hier)]
                ax.plot([p for p, _ in pts], [r["time_s"] * 1e3 for _, r in pts], "-", color=color, label=name)
                for P, r in pts:  # filled where compute-bound, hollow where comm-bound (save_figure's legend)
                    ax.plot(
                        P,
                        r["time_s"] * 1e3,
                        "o",
                        ms=3,
                        color=color,
                        mfc=color if r["regime"] == "compute-bound" else "white",
                    )
            ax.plot(Ps, [byP[P][0]["one_gpu_s"] / P * 1e3 for P in Ps], "k--", lw=1, label="compute floor T1/P")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{preset}, S={S // 1024}K, {h}", fontsize=7)
            if j == 0:
                ax.set_ylabel("ms / layer (fwd+bwd)")
            if i == len(presets) - 1:
                ax.set_xlabel("P")
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    save_figure(fig, path, what, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    # ib-2x8 is h100-nvswitch-8 with another default size: the same predictions
    ap.add_argument("--presets", nargs="+", default=[p for p in HARDWARE_PRESETS if p != "ib-2x8"])
    ap.add_argument("--max-P", type=int, default=1024)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows = run(
        a.presets, SEQS, [p for p in PS if p <= a.max_P], partial=os.path.join(a.out, "scaling_study.partial.json")
    )
    write(rows, a.out)
    os.remove(os.path.join(a.out, "scaling_study.partial.json"))
    print(f"wrote {a.out}/scaling_study.{{json,md,png}} ({len(rows)} predictions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
