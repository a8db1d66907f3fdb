"""Validate the cost model against the interconnect testbed, and ``auto`` against the measured best.

    sudo python bench/validate_model.py                 # measure the grid on the testbed, then compare
    python bench/validate_model.py --from-json bench/results/archive/model_measurements.json   # re-compare only

Grid (24 configurations): testbed topology {switch, ring, mesh} x {MHA (H=Hkv=8), GQA (H=8, Hkv=2)} x
{non-causal, causal (zigzag)} x link rate {100, 400} Mbit/s per direction; P=4 ranks, S=4096, d=64, float32,
forward, 1 thread per rank. Every strategy is measured in each configuration (``tokenring.tools.bench``
inside ``tokenring.tools.testbed``: median of the timed calls, slowest rank) and predicted by ``tokenring.sim`` with

- the topology preset ``<kind>:<rate>mbit`` (tbf efficiency, loopback cap, per-message latency), and
- the kernel model calibrated on this CPU at the start (``calibrate_cpu``: one timing process, slowed by the
  ranks' core share cores / (P x threads) = 0.5 for 4 ranks on 2 cores; ``--calib concurrent`` times P
  processes at once instead, which on 2 cores proved noisier), and the testbed topology's CPU cost per byte
  moved (``cpu_per_byte``: the network stack runs on the cores that compute).

``auto`` is scored by what it would choose (``tokenring.choose_strategy`` with the testbed topology set,
i.e. its analytic CPU model, not the calibration) and that strategy's measured time vs the measured best.

Writes ``bench/results/model_measurements.json`` (raw, as measured), ``model_validation.json``,
``model_validation.md`` (the table) and ``model_validation.png`` (predicted vs measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402
import torch  # noqa: E402

import tokenring  # noqa: E402
from tokenring.sim import get_topology, simulate  # noqa: E402
from tokenring.sim.kernel_model import cpu_share, kernel_model  # noqa: E402
from tokenring.sim.simulator import shapes_for  # noqa: E402
from tokenring.tools import DTYPES  # noqa: E402

OURS = ("token_ring", "ring", "ulysses")


def grid(topologies, rates, heads, causals):
    for topo, (H, Hkv), causal, rate in itertools.product(topologies, heads, causals, rates):
        yield dict(topology=topo, rate_mbit=rate, H=H, Hkv=Hkv, causal=causal)


def measure(cfg, a) -> dict:
    from tokenring.tools import bench
    from tokenring.tools.testbed import Testbed

    spec = bench.make_spec(
        P=a.P,
        S=a.S,
        H=cfg["H"],
        Hkv=cfg["Hkv"],
        d=a.d,
        dtype=a.dtype,
        causal=cfg["causal"],
        mode="fwd",
        strategies=OURS,
        warmup=1,
        repeats=a.repeats,
        trace=False,
        comm_only=False,
        threads=a.threads,
        timeout=300.0,
    )
    t0 = time.time()
    with Testbed(a.P, cfg["topology"], cfg["rate_mbit"]) as tb:
        res = bench.run(spec, **tb.launch_kwargs())
    times = {r["strategy"]: r["time"] for r in res["results"] if "time" in r}
    checks = {r["strategy"]: r.get("check", {}).get("ok", True) for r in res["results"] if "time" in r}
    spread = {r["strategy"]: [r["time_min"], r["time_max"]] for r in res["results"] if "time" in r}
    print(
        f"  measured {cfg} in {time.time() - t0:.0f} s: "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in times.items()),
        flush=True,
    )
    return dict(
        cfg, P=a.P, S=a.S, d=a.d, dtype=a.dtype, threads=a.threads, times=times, spread=spread, checks_ok=checks
    )


def predict(m: dict, km) -> dict:
    topo = get_topology(f"{m['topology']}:{m['rate_mbit']:g}mbit", m["P"])
    sh = shapes_for(m["S"], m["P"], m["H"], m["Hkv"], m["d"], 1, DTYPES[m["dtype"]])
    out = {}
    for st in m["times"]:
        r = simulate(st, sh, topo, km, causal=m["causal"], backward=False)
        out[st] = dict(time=r.time, regime=r.regime, exposed=r.exposed_comm, compute=r.compute)
    return out


def auto_pick(m: dict) -> str:
    old = os.environ.get("TOKENRING_TOPOLOGY")
    threads = torch.get_num_threads()
    torch.set_num_threads(m["threads"])
    try:
        return tokenring.choose_strategy(
            m["H"],
            m["Hkv"],
            m["P"],
            B=1,
            s=m["S"] // m["P"],
            d=m["d"],
            dtype=DTYPES[m["dtype"]],
            causal=m["causal"],
            backward=False,
            topology=f"{m['topology']}:{m['rate_mbit']:g}mbit",
        )
    finally:
        torch.set_num_threads(threads)
        if old is not None:
            os.environ["TOKENRING_TOPOLOGY"] = old


def report(meas: list, km, out_dir: str) -> dict:
    rows, errs = [], []
    auto_ok = 0
    for m in meas:
        pred = predict(m, km)
        best_st = min(m["times"], key=m["times"].get)
        best = m["times"][best_st]
        pick = auto_pick(m)
        pick_ratio = m["times"][pick] / best if pick in m["times"] else float("nan")
        auto_ok += pick_ratio <= 1.10
        for st, t in m["times"].items():
            e = (pred[st]["time"] - t) / t
            errs.append(abs(e))
            rows.append(
                dict(
                    topology=m["topology"],
                    rate_mbit=m["rate_mbit"],
                    heads=f"{m['H']}/{m['Hkv']}",
                    attn="GQA" if m["Hkv"] < m["H"] else "MHA",
                    causal=m["causal"],
                    strategy=st,
                    measured_s=t,
                    predicted_s=pred[st]["time"],
                    error=e,
                    regime=pred[st]["regime"],
                    best_measured=st == best_st,
                    auto_pick=st == pick,
                    auto_vs_best=pick_ratio,
                )
            )
    summary = dict(
        configurations=len(meas),
        comparisons=len(errs),
        median_abs_error=statistics.median(errs) if errs else None,
        worst_abs_error=max(errs) if errs else None,
        auto_within_10pct=auto_ok,
        auto_fraction=auto_ok / max(1, len(meas)),
        kernel_model=km.name,
        kernel_source=km.source,
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model_validation.json"), "w") as f:
        json.dump(dict(summary=summary, rows=rows), f, indent=1)
    lines = [
        "# Cost model vs testbed measurement",
        "",
        "Regenerate: `sudo python bench/validate_model.py` (measures, ~10 min on 2 cores) or "
        "`python bench/validate_model.py --from-json bench/results/archive/model_measurements.json` (re-predicts).",
        "",
        f"Configurations: {summary['configurations']}, comparisons (config x strategy): {summary['comparisons']}. "
        f"Kernel model: {km.name} ({km.source}).",
        "",
        f"**median |predicted - measured| / measured = {summary['median_abs_error']:.1%}, worst = "
        f"{summary['worst_abs_error']:.1%}**; `auto` within 10% of the measured best in "
        f"**{auto_ok}/{len(meas)}** configurations ({summary['auto_fraction']:.0%}).",
        "",
        "| topology | Mbit/s | heads | causal | strategy | measured ms | predicted ms | error | regime | best | auto |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['rate_mbit']:g} | {r['attn']} {r['heads']} | {r['causal']} | "
            f"{r['strategy']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
            f"{r['error']:+.1%} | {r['regime']} | {'*' if r['best_measured'] else ''} | "
            f"{'auto (x%.2f)' % r['auto_vs_best'] if r['auto_pick'] else ''} |"
        )
    with open(os.path.join(out_dir, "model_validation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(rows, os.path.join(out_dir, "model_validation.png"), summary)
    return summary


PAPER = dict(ring_ms=7.6, token_ring_ms=(3.5, 4.6))


def paper_check(out_dir: str) -> dict:
    """TokenRing paper, 4x A10 PCIe, S=24000, H=32, d=128, forward: per-step ring ~7.6 ms (comm-bound),
    TokenRing ~3.5 ms (steps 0-1) and ~4.6 ms (step 2). Predicted per-step times, two readings."""
    topo = get_topology("a10-pcie-4")
    sh = shapes_for(24000, 4, 32, 32, 128, 1, torch.bfloat16)
    km = kernel_model(topo.device)
    res = {n: simulate(n, sh, topo, km, causal=False, backward=False) for n in ("ring", "token_ring")}
    steps = {
        n: [dict(time_ms=s.time * 1e3, compute_ms=s.compute * 1e3, comm_ms=s.comm * 1e3) for s in r.passes[0].steps]
        for n, r in res.items()
    }
    # Steps that carry traffic of the steady state: ring 0..P-2; token_ring 1..P-1 (Q relay + partials).
    ring_comm = [s["comm_ms"] for s in steps["ring"] if s["comm_ms"] > 0]
    tr_comm = [s["comm_ms"] for s in steps["token_ring"] if s["comm_ms"] > 0]
    ring_time = [s["time_ms"] for s in steps["ring"][:3]]
    tr_time = [s["time_ms"] for s in steps["token_ring"][:4]]
    lo, hi = PAPER["token_ring_ms"]
    ok_comm = all(abs(x - PAPER["ring_ms"]) <= 0.25 * PAPER["ring_ms"] for x in ring_comm) and all(
        lo * 0.75 <= x <= hi * 1.25 for x in tr_comm
    )
    flops = 4 * 6000 * 6000 * 32 * 128
    out = dict(
        paper=PAPER,
        topology=topo.describe(),
        topology_source=topo.source,
        kernel_model=km.name,
        kernel_source=km.source,
        steps=steps,
        reading_comm=dict(
            ring_ms=ring_comm,
            token_ring_ms=tr_comm,
            ratio=statistics.mean(ring_comm) / statistics.mean(tr_comm),
            within_25pct=ok_comm,
        ),
        reading_full=dict(ring_ms=ring_time, token_ring_ms=tr_time),
        note=(
            f"One step computes a 6000x6000 block over 32 heads: {flops / 1e9:.0f} GFLOP; at the A10's 125 TFLOP/s "
            f"fp16 peak that alone is {flops / 125e12 * 1e3:.1f} ms, and our A10 kernel model (FlashAttention-2 at "
            f"~60% of peak, plus the unfused float32 merge) gives ~{steps['ring'][0]['compute_ms']:.1f} ms. So the "
            f"paper's 3.5 ms TokenRing step cannot include the full non-causal block at that shape. Our model "
            f"reproduces the paper's numbers under the reading that they are the per-step communication (compute "
            f"hidden or much smaller, e.g. a smaller timed configuration): ring moves 98 MB of K/V over one P2P "
            f"stream (~13 GB/s -> {statistics.mean(ring_comm):.1f} ms), TokenRing moves 49 MB of Q and 49 MB of "
            f"partials to two different peers at once ({min(tr_comm):.1f}-{max(tr_comm):.1f} ms). The assumption "
            f"that makes the 1.9x possible on a PCIe switch is a per-flow cap below the port rate (a single "
            f"P2P copy stream does not fill a PCIe 4.0 x16 port); with one flow able to fill the port, the two "
            f"would tie as on any switch. Caveat: that per-flow cap (13 GB/s) was set from the paper's own ring "
            f"figure, "
            f"so ring's match is by construction; TokenRing's per-step time is then a prediction."
        ),
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model_paper_a10.json"), "w") as f:
        json.dump(out, f, indent=1)
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    md = [
        "# Against the TokenRing paper: 4x A10 PCIe, S=24000, H=32, d=128, forward",
        "",
        f"Topology `{topo.describe()}`: {topo.source}",
        "",
        "| | paper | predicted, comm per step | predicted, full step (compute included) |",
        "|---|---|---|---|",
        f"| ring | ~7.6 ms | {fmt(ring_comm)} ms | {fmt(ring_time)} ms |",
        f"| token_ring | ~3.5 ms (steps 0-1), ~4.6 ms (step 2) | {fmt(tr_comm)} ms | {fmt(tr_time)} ms |",
        f"| ratio | ~1.9x | {out['reading_comm']['ratio']:.2f}x | |",
        "",
        f"Within 25% (communication reading): **{ok_comm}**.",
        "",
        out["note"],
        "",
    ]
    with open(os.path.join(out_dir, "model_paper_a10.md"), "w") as f:
        f.write("\n".join(md))
    return out


def _plot(rows, path, summary):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.2, 5.6))
    colors = {"token_ring": "tab:red", "ring": "tab:blue", "ulysses": "tab:green"}
    marks = {"switch": "o", "ring": "s", "mesh": "^"}
    for r in rows:
        ax.plot(
            r["measured_s"] * 1e3,
            r["predicted_s"] * 1e3,
            marks.get(r["topology"], "x"),
            color=colors.get(r["strategy"], "k"),
            mfc="white" if r["causal"] else colors.get(r["strategy"], "k"),
            ms=6,
        )
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 0.8
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.2
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=1)
    ax.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="0.85", zorder=0, label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms (testbed)")
    ax.set_ylabel("predicted ms (tokenring.sim)")
    for st, c in colors.items():
        ax.plot([], [], "o", color=c, label=st)
    for t, mk in marks.items():
        ax.plot([], [], mk, color="0.3", label=t)
    ax.legend(fontsize=8, title="hollow: causal", title_fontsize=8)
    ax.set_title(
        f"median |err| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%}; "
        f"auto ok {summary['auto_within_10pct']}/{summary['configurations']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-json", default=None, help="skip measuring: use these measurements")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--topologies", nargs="+", default=["switch", "ring", "mesh"])
    ap.add_argument("--rates", type=float, nargs="+", default=[100.0, 400.0])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--attn", choices=["both", "mha", "gqa"], default="both")
    ap.add_argument("-P", type=int, default=4)
    ap.add_argument("-S", type=int, default=4096)
    ap.add_argument("-d", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--calib",
        choices=["concurrent", "share"],
        default="share",
        help="CPU kernel calibration: one process scaled by cores/(P*threads) (default), or P at once",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the configurations already in model_measurements.json and measure only the missing ones",
    )
    a = ap.parse_args(argv)
    pc = paper_check(a.out)
    print(
        f"paper check (a10-pcie-4): ring comm/step {pc['reading_comm']['ring_ms']} ms, token_ring "
        f"{pc['reading_comm']['token_ring_ms']} ms, within 25%: {pc['reading_comm']['within_25pct']}"
    )
    heads = {"mha": [(8, 8)], "gqa": [(8, 2)], "both": [(8, 8), (8, 2)]}[a.attn]
    causals = {"yes": [True], "no": [False], "both": [False, True]}[a.causal]
    raw_path = os.path.join(a.out, "model_measurements.json")
    meas, ok = _results.measurements(a.from_json, "validate_model")
    if not ok:
        return 2
    if meas is None:
        meas = []
        os.makedirs(a.out, exist_ok=True)
        if a.resume and os.path.exists(raw_path):
            with open(raw_path) as f:
                meas = json.load(f)["measurements"]
        key = lambda c: (c["topology"], c["rate_mbit"], c["H"], c["Hkv"], c["causal"])
        done = {key(m) for m in meas}
        for cfg in grid(a.topologies, a.rates, heads, causals):
            if key(cfg) in done:
                continue
            meas.append(measure(cfg, a))
            with open(raw_path, "w") as f:  # incremental: a partial grid survives an interruption
                json.dump(dict(machine=_machine(), measurements=meas), f, indent=1)
    threads = meas[0]["threads"] if meas else a.threads
    P = meas[0]["P"] if meas else a.P
    dt = DTYPES[meas[0]["dtype"] if meas else a.dtype]
    if a.calib == "concurrent":  # P timing processes at once, like the ranks: contention measured
        km = kernel_model("cpu", threads, calibrated=True, dtype=dt, concurrent=P)
    else:  # one timing process, slowed by the core share
        km = kernel_model("cpu", threads, calibrated=True, dtype=dt, share=cpu_share(P, threads))
    s = report(meas, km, a.out)
    print(
        f"median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} over "
        f"{s['comparisons']} comparisons; auto within 10% of best in {s['auto_within_10pct']}/"
        f"{s['configurations']} configurations; wrote {a.out}/model_validation.{{json,md,png}}"
    )
    return 0


def _machine() -> dict:
    from tokenring.tools.bench import machine

    return machine()


if __name__ == "__main__":
    raise SystemExit(main())
