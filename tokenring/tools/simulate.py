"""``tokenring simulate``: predicted time of every strategy for given shapes on modelled interconnects.

    tokenring simulate --topology a10-pcie-4 --seq 24000 --heads 32 --head-dim 128 [--causal] [--pass both]
    tokenring simulate --topology mesh:200mbit h100-nvswitch-8 -P 8 --seq 131072 --kv-heads 8 --steps
    tokenring simulate --sweep [--topology ...] --out DIR      # time vs P (2..1024) and vs S, JSON + PNG

``--topology`` takes presets (``a10-pcie-4``, ``h100-nvswitch-8``, ``h200-nvswitch-8``, ``ascend910b-mesh-8``,
``mi300x-mesh-8``, ``ib-2x8``, ``switch``/``ring``/``mesh`` with ``:RATE``, ``cluster:NODE:INTRA:INTER``,
``loopback``; presets beyond one node become clusters of nodes joined by their stated NICs) or JSON/YAML files (see
:func:`tokenring.sim.topology.topology_from_dict`); default ``$TOKENRING_TOPOLOGY`` or every hardware preset.
"""

from __future__ import annotations

import argparse
import json
import os

from .. import settings
from ..sim.auto import fmt_time
from ..sim.kernel_model import kernel_model
from ..sim.simulator import candidates, shapes_for, simulate
from ..sim.topology import get_topology
from ..strategies import STRATEGIES, runnable, why_not
from . import DTYPES

__all__ = ["main", "sweep", "plot_curves", "save_figure", "HARDWARE_PRESETS"]

HARDWARE_PRESETS = ["a10-pcie-4", "h100-nvswitch-8", "h200-nvswitch-8", "ascend910b-mesh-8", "mi300x-mesh-8", "ib-2x8"]
TESTBED_PRESETS = ["switch:200mbit", "ring:200mbit", "mesh:200mbit"]
SWEEP_P = [2**i for i in range(1, 11)]
SWEEP_S = [2**i for i in range(13, 21)]  # 8K .. 1M


def _round_S(S: int, P: int, causal: bool) -> int:
    m = 2 * P if causal else P
    return -(-S // m) * m


def _strategies(requested, H, Hkv, P):
    """The requested strategies that can run (default: those ``auto`` chooses among)."""
    return runnable(H, Hkv, P, requested) if requested else candidates(H, P, Hkv)


def predict(topo_spec, S, P, H, Hkv, d, B, dtype, causal, backward, strategies=None, kernel=None) -> list:
    topo = get_topology(topo_spec, P)
    sh = shapes_for(_round_S(S, P, causal), P, H, Hkv, d, B, dtype)
    km = kernel or kernel_model(topo.device)
    return [simulate(n, sh, topo, km, causal=causal, backward=backward) for n in _strategies(strategies, H, Hkv, P)]


def sweep(
    topologies, S, P, H, Hkv, d, B, dtype, causal, backward, strategies=None, Ps=SWEEP_P, Ss=SWEEP_S, log=print
) -> dict:
    """For each topology: every strategy's predicted time vs P (S fixed) and vs S (P fixed)."""
    out = {}
    for spec in topologies:
        base = get_topology(spec)
        Pfix = P or base.P
        rec = dict(topology=spec, source=base.source, vs_P=dict(S=S, points=[]), vs_S=dict(P=Pfix, points=[]))
        for p in Ps:
            for r in predict(spec, S, p, H, Hkv, d, B, dtype, causal, backward, strategies):
                rec["vs_P"]["points"].append(
                    dict(
                        P=p,
                        S=r.shapes.s * p,
                        strategy=r.strategy,
                        time_s=r.time,
                        regime=r.regime,
                        exposed_comm_s=r.exposed_comm,
                    )
                )
        for s in Ss:
            for r in predict(spec, s, Pfix, H, Hkv, d, B, dtype, causal, backward, strategies):
                rec["vs_S"]["points"].append(
                    dict(
                        P=Pfix,
                        S=r.shapes.s * Pfix,
                        strategy=r.strategy,
                        time_s=r.time,
                        regime=r.regime,
                        exposed_comm_s=r.exposed_comm,
                    )
                )
        log(f"  {spec}: done")
        out[spec] = rec
    return out


COLORS = {"token_ring": "tab:red", "ring": "tab:blue", "ulysses": "tab:green", "ring_bidir": "tab:purple"}


def plot_curves(ax, points: list[dict], x: str, ms_key: str = "time_s") -> None:
    """One line per strategy of ``points`` (dicts with ``strategy``, ``x``, ``ms_key`` in seconds, ``regime``)
    on log-log axes; markers filled where compute-bound, hollow where comm-bound."""
    for st, color in COLORS.items():
        ps = [p for p in points if p["strategy"] == st]
        if not ps:
            continue
        ax.plot([p[x] for p in ps], [p[ms_key] * 1e3 for p in ps], "-", color=color, label=st)
        for p in ps:
            ax.plot(
                p[x], p[ms_key] * 1e3, "o", color=color, ms=4, mfc=color if p["regime"] == "compute-bound" else "white"
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def plot_sweep(data: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data)
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.1 * n), squeeze=False)
    for i, (spec, rec) in enumerate(data.items()):
        for j, (key, x) in enumerate((("vs_P", "P"), ("vs_S", "S"))):
            ax = axes[i][j]
            plot_curves(ax, rec[key]["points"], x)
            ax.set_xlabel(x)
            ax.set_ylabel("ms")
            fixed = f"S={rec['vs_P']['S']}" if key == "vs_P" else f"P={rec['vs_S']['P']}"
            ax.set_title(f"{spec}, {fixed}", fontsize=9)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    save_figure(fig, path, title, dpi=110)


def save_figure(fig, path: str, title: str, dpi: int) -> None:
    """Title (with the marker legend of :func:`plot_curves`), lay out, write and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.suptitle(title + "  (filled marker: compute-bound, hollow: comm-bound)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenring simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--topology", nargs="+", default=None, help="presets, kind:RATE or JSON/YAML files")
    ap.add_argument("-P", "--ranks", type=int, default=None, help="ranks (default: the topology's own)")
    ap.add_argument("--seq", type=int, default=24000, help="global sequence length S")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pass", dest="mode", default="fwd", choices=["fwd", "both"])
    ap.add_argument("--strategies", nargs="+", default=None, choices=list(STRATEGIES))
    ap.add_argument("--steps", action="store_true", help="print per-step time, compute and comm")
    ap.add_argument("--calibrate-cpu", action="store_true", help="for cpu topologies, time this CPU's kernels")
    ap.add_argument("--json", default=None, help="write the predictions here")
    ap.add_argument("--sweep", action="store_true", help="time vs P (2..1024) and vs S (8K..1M), JSON + PNG")
    ap.add_argument("--out", default="tokenring-simulate", help="directory for --sweep outputs")
    ap.add_argument("--stem", default="simulate_sweep", help="file name stem of the --sweep outputs")
    a = ap.parse_args(argv)
    dtype, backward = DTYPES[a.dtype], a.mode == "both"
    Hkv = a.kv_heads or a.heads
    configured = settings.get("topology")
    topologies = a.topology or ([configured] if configured is not None else HARDWARE_PRESETS)
    try:
        for t in topologies:
            get_topology(t)
    except (ValueError, OSError) as e:
        print(f"tokenring simulate: {e}")
        return 2
    if a.sweep:
        os.makedirs(a.out, exist_ok=True)
        print(
            f"sweeping {len(topologies)} topologies (S={a.seq} for the P sweep; P sweep up to 1024 builds "
            f"large schedules once, ~1 min)"
        )
        data = sweep(
            topologies, a.seq, a.ranks, a.heads, Hkv, a.head_dim, a.batch, dtype, a.causal, backward, a.strategies
        )
        stem = os.path.join(a.out, a.stem)
        meta = dict(H=a.heads, Hkv=Hkv, d=a.head_dim, B=a.batch, dtype=a.dtype, causal=a.causal, pass_=a.mode)
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, topologies=data), f, indent=1)
        plot_sweep(
            data,
            stem + ".png",
            f"predicted attention time, H={a.heads} Hkv={Hkv} d={a.head_dim} {a.dtype} causal={a.causal} pass={a.mode}",
        )
        print(f"wrote {stem}.json and {stem}.png")
        return 0
    allres = []
    for spec in topologies:
        P = a.ranks or get_topology(spec).P
        topo = get_topology(spec, P)
        km = kernel_model(topo.device, calibrated=a.calibrate_cpu)
        res = predict(spec, a.seq, P, a.heads, Hkv, a.head_dim, a.batch, dtype, a.causal, backward, a.strategies, km)
        if not res:
            why = "; ".join(w for w in (why_not(n, a.heads, Hkv, P) for n in a.strategies or STRATEGIES) if w)
            print(f"{spec}: no strategy can run ({why})")
            continue
        best = min(r.time for r in res)
        sh = res[0].shapes
        print(
            f"\n{topo.describe()}  kernels: {km.name}  S={sh.s * P} B={sh.B} H={sh.H} Hkv={sh.Hkv} d={sh.d} "
            f"{a.dtype} causal={a.causal} pass={a.mode}"
        )
        w = max(11, *(len(r.strategy) + 2 for r in res))
        print(f"  {'strategy':<{w}}{'time':>12}{'vs best':>9}{'compute':>12}{'exposed':>12}  regime")
        for r in sorted(res, key=lambda r: r.time):
            print(
                f"  {r.strategy:<{w}}{fmt_time(r.time):>12}{r.time / best:>8.2f}x{fmt_time(r.compute):>12}"
                f"{fmt_time(r.exposed_comm):>12}  {r.regime}"
            )
            if a.steps:
                for p in r.passes:
                    cells = " ".join(f"{s.time * 1e3:.3g}({s.compute * 1e3:.3g}|{s.comm * 1e3:.3g})" for s in p.steps)
                    print(f"      {'bwd' if p.backward else 'fwd'} steps ms, time(compute|comm): {cells}")
        allres += [r.to_dict() for r in res]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(allres, f, indent=1)
        print(f"\nwrote {a.json}")
    return 0
