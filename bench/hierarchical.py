#!/usr/bin/env python3
"""Hierarchical against flat strategies on the two-level testbed, per call, side by side (needs root):

    sudo .venv/bin/python bench/hierarchical.py            # writes bench/results/hierarchical.{md,json}
    sudo .venv/bin/python bench/hierarchical.py --quick    # one configuration: a smoke run

The testbed (``tokenring testbed --topology cluster``): nodes of 2 ranks, a mesh inside each node at 4x the
inter-node rate, and one NIC link per node (shared by its ranks) to a switch.

1. Calibrate on unshaped local ranks: one forward block's compute ``C`` (ring's median compute per step).
   The *inter-node comm-bound* rate is the one at which ring's K/V message per step takes ``RATIO * C`` on
   the NIC link (flat ring sends one K/V block across each node boundary per step).
2. On 2 nodes x 2 ranks (and 3 x 2 with ``--big``): MHA and GQA (H=8, Hkv=2), causal (zigzag) forward and
   forward+backward, non-causal forward, at the comm-bound rate (GQA at its own: the rate times Hkv/H, as its
   K/V per step is that much smaller); both again at half the rate, causal forward+backward. Each run
   measures every flat strategy (ring, ring_bidir, ulysses, the TokenRing variant the cost model picks,
   ``ring:auto``) and every hierarchical one (usp, double_ring, token_ring_2d's picked variant, a direct
   double ring whole and in outer chunks ``o=4``) and ``auto``,
   with ``$LOCAL_WORLD_SIZE`` = 2 as torchrun would set it; forward+backward cases also run the two-level
   strategies with ``keep`` (forward's inter-node K/V reused in backward; the direct one with o = 1, 2, 4).
   Each case also measures its compute floor: ring's computes on unshaped local ranks (the sum of the slowest
   rank's per step), so ``best flat / floor`` bounds the ratio any schedule could reach against the best flat one.
3. The simulator's prediction of every measured variant on the same two-level topology (model as committed,
   its CPU kernel model calibrated on this machine after the measurements, as ``bench/evidence.py`` does).
No number in the outputs is typed by hand; every repeat is kept in the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # a fresh clone works without installing

from _results import write  # noqa: E402

from tokenring.tools import bench, testbed  # noqa: E402

S, H, D, NODE, RATIO, INTRA, GQA_KV = 4096, 8, 64, 2, 3.0, 4.0, 2
FLAT = ["ring", "ring_bidir", "ulysses", "token_ring", "ring:auto"]
HIER = ["usp", "double_ring", "token_ring_2d", "double_ring:direct,c=1,k=1", "double_ring:direct,c=1,k=1,o=4"]
KEEP = [
    "double_ring:keep",
    "token_ring_2d:keep",
    "double_ring:direct,c=1,k=1,keep",  # forward+backward only
    "double_ring:direct,c=1,k=1,keep,o=2",
    "double_ring:direct,c=1,k=1,keep,o=4",
]
STRATEGIES = FLAT + HIER + KEEP + ["auto"]


def ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def by_name(res: dict) -> dict:
    return {r["strategy"]: r for r in res["results"]}


def calibrate(repeats: int) -> dict:
    res = bench.run(bench.make_spec(P=4, S=S, H=H, d=D, strategies=["ring"], repeats=repeats, comm_only=False))
    c = by_name(res)["ring"]["compute_per_step"]
    kv = 2 * (S // 4) * H * D * 4
    rate = kv * 8 / (RATIO * c) / 1e6
    return dict(
        block_compute_s=c,
        kv_bytes_per_step=kv,
        exact_rate_mbit=rate,
        rate_mbit=max(10, round(rate / 5) * 5),
        ratio=RATIO,
    )


def predict(res: dict) -> dict:
    """The model's prediction per measured strategy (its resolved variant) on this testbed's topology, with the
    CPU kernel model calibrated on this machine (as ``bench/evidence.py`` validates it)."""
    import torch

    from tokenring.schedules import Shapes
    from tokenring.sim import get_topology, kernel_model, simulate
    from tokenring.sim.kernel_model import cpu_share

    sp, tb = res["spec"], res["testbed"]
    dt = getattr(torch, sp["dtype"])
    sh = Shapes(sp["B"], sp["S"] // sp["P"], sp["H"], sp["Hkv"], sp["d"], dt, sp["P"])
    topo = get_topology(tb["spec"], sp["P"])
    km = kernel_model("cpu", sp["threads"], calibrated=True, dtype=dt, share=cpu_share(sp["P"], sp["threads"]))
    return {
        r["strategy"]: simulate(
            r["variant"], sh, topo, km, causal=sp["causal"], layout=sp["layout"], backward=sp["pass"] != "fwd"
        ).time
        for r in res["results"]
        if "time" in r and r.get("variant")
    }


def run_case(
    tag: str,
    P: int,
    rate: float,
    Hkv: int,
    causal: bool,
    mode: str,
    repeats: int,
    node: int = NODE,
    intra: float = INTRA,
    d: int = D,
    dtype: str = "float32",
    s: int = S // 4,
) -> dict:
    names = [n for n in STRATEGIES if mode != "fwd" or n not in KEEP]  # keep changes backward only
    shape = dict(P=P, S=s * P, H=H, Hkv=Hkv, d=d, causal=causal, mode=mode, dtype=dtype, repeats=repeats)
    spec = bench.make_spec(**shape, strategies=names, warmup=1, trace=True, comm_only=False)
    with testbed.Testbed(P, "cluster", rate, node=node, intra_mbit=intra * rate) as tb:
        # the whole run's watchdog: ~17 strategies x 4 calls, GQA token_ring at a quarter rate takes ~13 s a call
        res = bench.run(spec, timeout=1800, **tb.launch_kwargs())
        res["testbed"] = dict(tb.describe(), dropped=tb.dropped())
    res["floor"] = bench.compute_floor(**shape)  # unshaped local ranks, same shapes
    res["case"] = tag
    res = bench.strip_events(res)
    for r in res["results"]:
        r.pop("full_outputs", None)
    res["predicted"] = predict(res)
    return res


def label(res: dict) -> str:
    sp = res["spec"]
    heads = "MHA" if sp["H"] == sp["Hkv"] else f"GQA {sp['H']}/{sp['Hkv']}"
    n = res["testbed"]["node"]
    extra = (
        ""
        if (sp["d"], sp["dtype"], sp["S"] // sp["P"]) == (D, "float32", S // 4)
        else f", d={sp['d']} {sp['dtype']} s={sp['S'] // sp['P']}"
    )
    ratio = res["testbed"]["intra_mbit"] / res["testbed"]["rate_mbit"]
    extra += "" if ratio == INTRA else f", intra {ratio:g}x"
    return (
        f"{sp['P'] // n}x{n}{extra}, {heads}, {'causal' if sp['causal'] else 'non-causal'}, "
        f"{'fwd' if sp['pass'] == 'fwd' else 'fwd+bwd'}, {res['testbed']['rate_mbit']:g} Mbit/s"
    )


def summary(runs: list[dict]) -> tuple[list[str], dict]:
    rows, errs, wins = [], [], []
    for res in runs:
        rs = {n: r for n, r in by_name(res).items() if "time" in r}
        flat = min((n for n in rs if n in FLAT), key=lambda n: rs[n]["time"])
        hier = min((n for n in rs if n in HIER + KEEP), key=lambda n: rs[n]["time"])
        ratio = rs[flat]["time"] / rs[hier]["time"]
        wins.append(ratio)
        cells = [
            f"{ms(rs[n]['time'])} [{ms(rs[n]['time_min'])}-{ms(rs[n]['time_max'])}]" if n in rs else "-"
            for n in STRATEGIES
        ]
        fl = res.get("floor")
        rows.append(
            f"| {label(res)} | {ms(fl)} | "
            + " | ".join(cells)
            + f" | {flat} | {hier} | **{ratio:.2f}x** | "
            + (f"{rs[flat]['time'] / fl:.2f}x |" if fl else "- |")
        )
        for n, r in rs.items():
            p = res["predicted"].get(n)
            if p is not None:
                errs.append(
                    dict(
                        case=label(res),
                        strategy=n,
                        variant=r["variant"],
                        measured=r["time"],
                        predicted=p,
                        error=p / r["time"] - 1,
                    )
                )
    return rows, dict(errors=errs, ratios=wins)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "hierarchical"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--big", action="store_true", help="also 3 nodes x 2 ranks (6 ranks on the cores)")
    ap.add_argument(
        "--heldout",
        action="store_true",
        help="the held-out grid (measured after the model is frozen) instead of the main one",
    )
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run from its partial JSON")
    ap.add_argument("--from-json", help="rewrite the report from an earlier run's JSON")
    ap.add_argument(
        "--repredict",
        action="store_true",
        help="with --from-json: predict the kept measurements again with the model as it is now",
    )
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            data = json.load(f)
        if a.repredict:
            for res in data["runs"]:
                res["predicted"] = predict(res)
            data["predicted_by"] = f".venv/bin/python bench/hierarchical.py --from-json {a.from_json} --repredict"
    elif testbed.available():
        print(f"hierarchical: cannot measure: {testbed.available()}. Use --from-json with an earlier run.")
        return 2
    else:
        runs, partial = [], a.out + ".partial.json"  # kept after every case: a crash loses one case, not all
        if a.resume and os.path.exists(partial):
            with open(partial) as f:
                old = json.load(f)
            cal, runs = old["calibration"], old["runs"]
        else:
            cal = calibrate(a.repeats)
        rate = cal["rate_mbit"]
        g = rate * GQA_KV / H  # GQA's K/V per step is Hkv/H of MHA's: its comm-bound rate scales with it
        plan = [
            ("main", 4, rate, H, True, "both"),
            ("main", 4, g, GQA_KV, True, "both"),
            ("main", 4, rate, H, True, "fwd"),
            ("main", 4, g, GQA_KV, True, "fwd"),
            ("main", 4, rate, H, False, "fwd"),
            ("main", 4, g, GQA_KV, False, "fwd"),
            ("sweep", 4, rate / 2, H, True, "both"),
            ("sweep", 4, g / 2, GQA_KV, True, "both"),
        ]
        if a.big:
            plan += [("big", 6, rate, H, True, "both"), ("big", 6, g, GQA_KV, True, "both")]
        if a.quick:
            plan = plan[:1]
        if a.heldout:  # measured after the model was frozen: other grids, shapes, dtypes and rates
            plan = [
                ("held-out", 6, rate, H, True, "both", dict(node=3)),
                ("held-out", 6, g, GQA_KV, True, "fwd", dict(node=3)),
                ("held-out", 4, rate * 2, H, False, "both", dict(intra=2.0, d=128, s=512)),
                ("held-out", 4, g * 2, GQA_KV, True, "both", dict(dtype="bfloat16", s=1536)),
                ("held-out", 6, rate / 2, H, False, "fwd", dict(node=2, intra=8.0)),
            ]
        for tag, P, r, Hkv, causal, mode, *kw in plan[len(runs) :]:
            print(f"{tag}: P={P} rate={r:g} Hkv={Hkv} causal={causal} {mode} {kw}", flush=True)
            runs.append(run_case(tag, P, r, Hkv, causal, mode, a.repeats, **(kw[0] if kw else {})))
            with open(partial, "w") as f:
                json.dump(dict(calibration=cal, runs=runs), f)
        flags = "".join(f" --{f}" for f in ("big", "heldout") if getattr(a, f))
        data = dict(
            calibration=cal,
            runs=runs,
            machine=bench.machine(),
            date=datetime.date.today().isoformat(),
            command=f"sudo .venv/bin/python bench/hierarchical.py{flags}"
            + (f" --out {os.path.relpath(a.out)}" if a.out != ap.get_default("out") else ""),
        )
        os.remove(partial)
    cal, runs = data["calibration"], data["runs"]
    rows, stats = summary(runs)
    errs = sorted(abs(e["error"]) for e in stats["errors"])
    m = data["machine"]
    L = [
        "# Hierarchical vs flat strategies on the two-level testbed",
        "",
        f"Generated by `{data.get('command', 'sudo .venv/bin/python bench/hierarchical.py --big')}` "
        f"on {data['date']}. Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, gloo, no GPU. "
        f"S={S} at P=4 ({S // 4} tokens per rank at every P), H={H}, d={D}, float32, B=1, one thread per rank. "
        f"Testbed: nodes of {NODE} ranks (unless the case says otherwise), a mesh of links at {INTRA:g}x the "
        f"inter-node rate inside each node (ditto), one NIC link per node (shared by its ranks) "
        f"to a switch; `tc tbf` per direction.",
        "",
        f"Calibration (unshaped): one forward block = {ms(cal['block_compute_s'])} ms; ring's K/V per step = "
        f"{cal['kv_bytes_per_step'] / 1e6:.2f} MB, which takes {cal['ratio']:g}x a block on the NIC link at "
        f"{cal['exact_rate_mbit']:.0f} Mbit/s: **inter-node rate {cal['rate_mbit']:g} Mbit/s** "
        f"(intra-node {INTRA * cal['rate_mbit']:g}).",
        "",
        "Each cell: median ms per call (slowest rank) [min-max] over the repeats (all in the JSON). Family names "
        "ran the variant the cost model picked for the testbed (`variant` in the JSON); the hierarchical ones "
        "took the node size from `$LOCAL_WORLD_SIZE`; `,keep` variants (forward+backward only) reuse forward's "
        "inter-node K/V in backward. Floor: ring's computes on unshaped local ranks, same shapes (sum over steps "
        "of the slowest rank's); `best flat / floor` is the most any schedule could gain over the best flat one "
        "if it hid every byte.",
        "",
        "| case | floor | " + " | ".join(STRATEGIES) + " | best flat | best hierarchical | flat / hierarchical | "
        "best flat / floor |",
        "|" + "---|" * (len(STRATEGIES) + 6),
    ] + rows
    L += [
        "",
        f"Best hierarchical vs best flat: {', '.join(f'{x:.2f}x' for x in stats['ratios'])}.",
        "",
        "## Simulator against these measurements",
        "",
        (
            f"Predictions re-made from the kept measurements by `{data['predicted_by']}` (the model as committed "
            f"then). "
            if data.get("predicted_by")
            else ""
        )
        + f"{len(errs)} predictions on the `cluster` topology (model as committed): median error "
        f"{100 * median(errs):.1f}%, worst {100 * errs[-1]:.1f}%.",
        "",
        "| case | strategy | variant | measured ms | predicted ms | error |",
        "|---|---|---|---|---|---|",
    ]
    for e in stats["errors"]:
        L.append(
            f"| {e['case']} | {e['strategy']} | {e['variant']} | {ms(e['measured'])} | {ms(e['predicted'])} | "
            f"{100 * e['error']:+.1f}% |"
        )
    data["summary"] = dict(ratios=stats["ratios"], median_error=median(errs), worst_error=errs[-1], n=len(errs))
    write(a.out, data, L)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
