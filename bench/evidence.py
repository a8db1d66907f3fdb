#!/usr/bin/env python3
"""Cost model and ``auto`` against the testbed with every run kept: the tuning grid re-measured, a held-out grid
measured after the model was frozen, and ``auto`` scored against the oracle and against fixed rules.

    sudo .venv/bin/python bench/evidence.py [--runs 3] [--repeats 2]      # measures (~1 h on 2 cores)
    .venv/bin/python bench/evidence.py --from-json bench/results/archive/evidence_measurements.json   # re-report

Grids (``tokenring.tools.testbed``: P network namespaces, tc-shaped veth links):
- **tuning**: the 24 configurations the model was adjusted on: topology {switch, ring, mesh} x {MHA 8/8, GQA
  8/2} x {non-causal, causal zigzag} x {100, 400} Mbit/s, P=4, S=4096, d=64, float32, forward.
- **held-out** (never used to adjust the model): P = 3 and 5, S up to 8192, d=128, causal forward+backward,
  bf16 and float32, the ring-of-links topology, compute-bound (1000 Mbit/s) and comm-bound (50 Mbit/s) points,
  H % P != 0 (Ulysses cannot run).

Each configuration is measured in ``--runs`` independent testbed sessions (namespaces rebuilt each time); a run
is the median of ``--repeats`` timed calls after a warm-up, slowest rank. Strategies: token_ring:relay,
token_ring:direct,c=2,k=1, ring, ulysses (where H % P == 0) and ``auto`` itself (resolved inside the run by the
cost model on the testbed's preset topology; its variant is recorded). Predictions: ``tokenring.sim`` on the
preset ``<kind>:<rate>mbit`` with the CPU kernel model calibrated once at the start, exactly as
``bench/validate_model.py`` does; the model code is unchanged between the grids.

``auto`` is scored per configuration by measured time(auto) / the best measured time (the oracle over the
measured strategies, auto included); fixed rules -- "MHA -> ulysses (token_ring:relay where H % P != 0),
GQA -> ring", and each single strategy (falling back to ring where it cannot run) -- by the same ratio of the
strategy they pick. Writes ``bench/results/evidence_measurements.json`` (every run), ``evidence.json`` and
``evidence.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402
import torch  # noqa: E402

from tokenring.sim import get_topology, simulate  # noqa: E402
from tokenring.sim.kernel_model import cpu_share, kernel_model  # noqa: E402
from tokenring.sim.simulator import shapes_for  # noqa: E402
from tokenring.strategies import why_not  # noqa: E402
from tokenring.tools import DTYPES  # noqa: E402

FIXED = ("token_ring:relay", "token_ring:direct,c=2,k=1", "ring", "ulysses")


def tuning_grid() -> list[dict]:
    out = []
    for topo, (H, Hkv), causal, rate in itertools.product(
        ("switch", "ring", "mesh"), ((8, 8), (8, 2)), (False, True), (100.0, 400.0)
    ):
        out.append(
            dict(
                set="tuning",
                topology=topo,
                rate_mbit=rate,
                P=4,
                S=4096,
                H=H,
                Hkv=Hkv,
                d=64,
                dtype="float32",
                causal=causal,
                mode="fwd",
            )
        )
    return out


def heldout_grid() -> list[dict]:
    c = dict(set="held-out", causal=True, mode="both")
    return [
        dict(c, topology="switch", rate_mbit=200.0, P=3, S=3072, H=8, Hkv=8, d=128, dtype="float32"),  # H%P != 0
        dict(c, topology="ring", rate_mbit=100.0, P=3, S=3072, H=6, Hkv=2, d=64, dtype="bfloat16"),
        dict(c, topology="mesh", rate_mbit=200.0, P=3, S=3072, H=6, Hkv=6, d=128, dtype="float32"),
        dict(c, topology="switch", rate_mbit=400.0, P=5, S=2560, H=10, Hkv=10, d=64, dtype="float32"),
        dict(c, topology="ring", rate_mbit=200.0, P=5, S=2560, H=8, Hkv=2, d=128, dtype="float32"),  # H%P != 0
        dict(c, topology="mesh", rate_mbit=50.0, P=4, S=4096, H=8, Hkv=8, d=64, dtype="float32"),  # comm-bound
        dict(c, topology="mesh", rate_mbit=1000.0, P=4, S=8192, H=8, Hkv=2, d=128, dtype="bfloat16"),  # compute
        dict(c, topology="ring", rate_mbit=400.0, P=4, S=8192, H=8, Hkv=8, d=128, dtype="float32"),
    ]


def strategies(cfg: dict) -> list[str]:
    return [s for s in FIXED if why_not(s, cfg["H"], cfg["Hkv"], cfg["P"]) is None] + ["auto"]


def key(cfg: dict) -> str:
    return (
        f"{cfg['set']}|{cfg['topology']}:{cfg['rate_mbit']:g}|P{cfg['P']}|S{cfg['S']}|{cfg['H']}/{cfg['Hkv']}|"
        f"d{cfg['d']}|{cfg['dtype']}|causal={cfg['causal']}|{cfg['mode']}"
    )


def measure_once(cfg: dict, a) -> dict:
    from tokenring.tools import bench
    from tokenring.tools.testbed import Testbed

    spec = bench.make_spec(
        P=cfg["P"],
        S=cfg["S"],
        H=cfg["H"],
        Hkv=cfg["Hkv"],
        d=cfg["d"],
        dtype=cfg["dtype"],
        causal=cfg["causal"],
        mode=cfg["mode"],
        strategies=strategies(cfg),
        warmup=1,
        repeats=a.repeats,
        trace=False,
        comm_only=False,
        threads=1,
        timeout=600.0,
    )
    with Testbed(cfg["P"], cfg["topology"], cfg["rate_mbit"]) as tb:
        res = bench.run(spec, **tb.launch_kwargs())
    out = {}
    for r in res["results"]:
        if "time" in r:
            out[r["strategy"]] = dict(
                time=r["time"],
                calls=r.get("times") or [r["time_min"], r["time_max"]],
                variant=r.get("variant", r["strategy"]),
                ok=r.get("check", {}).get("ok", True),
            )
    return out


def predictor(a):
    cache = {}

    def km(cfg):
        k = (cfg["P"], cfg["dtype"])
        if k not in cache:
            cache[k] = kernel_model("cpu", 1, calibrated=True, dtype=DTYPES[cfg["dtype"]], share=cpu_share(cfg["P"], 1))
        return cache[k]

    def predict(cfg: dict, spec: str) -> float:
        topo = get_topology(f"{cfg['topology']}:{cfg['rate_mbit']:g}mbit", cfg["P"])
        sh = shapes_for(cfg["S"], cfg["P"], cfg["H"], cfg["Hkv"], cfg["d"], 1, DTYPES[cfg["dtype"]])
        return simulate(
            spec,
            sh,
            topo,
            km(cfg),
            causal=cfg["causal"],
            backward=cfg["mode"] == "both",
            queued=False if a.plain else None,
        ).time

    return predict


def rule_pick(rule: str, cfg: dict) -> str:
    ok = lambda s: why_not(s, cfg["H"], cfg["Hkv"], cfg["P"]) is None
    if rule == "MHA->ulysses, GQA->ring":
        if cfg["Hkv"] < cfg["H"]:
            return "ring"
        return "ulysses" if ok("ulysses") else "token_ring:relay"
    return rule if ok(rule) else "ring"


RULES = ("MHA->ulysses, GQA->ring",) + FIXED


def report(meas: list[dict], predict, out_dir: str, runs: int, stem: str = "evidence") -> dict:
    rows, summary = [], {}
    for m in meas:
        cfg, got = m["cfg"], m["runs"]
        names = sorted({s for r in got for s in r})
        med = {s: statistics.median(r[s]["time"] for r in got if s in r) for s in names}
        best = min(med.values())
        auto_variant = next((r["auto"]["variant"] for r in got if "auto" in r), None)
        pred = {}
        for s in names:
            spec = auto_variant if s == "auto" else s
            pred[s] = predict(cfg, spec)
        for s in names:
            per_run = [r[s]["time"] for r in got if s in r]
            errs = [(pred[s] - t) / t for t in per_run]
            rows.append(
                dict(
                    key=key(cfg),
                    set=cfg["set"],
                    strategy=s,
                    variant=auto_variant if s == "auto" else s,
                    runs=per_run,
                    median=med[s],
                    spread=(max(per_run) - min(per_run)) / med[s],
                    predicted=pred[s],
                    error_median=(pred[s] - med[s]) / med[s],
                    errors_per_run=errs,
                    vs_best=med[s] / best,
                )
            )
        m["auto_ratio"] = med["auto"] / best
        m["rules"] = {rule: med[rule_pick(rule, cfg)] / best for rule in RULES if rule_pick(rule, cfg) in med}
        m["oracle"] = min(med, key=med.get)
    for part in ("tuning", "held-out"):
        rs = [r for r in rows if r["set"] == part]  # auto's rows: the prediction of the variant it ran
        if not rs:
            continue
        med_err = [abs(r["error_median"]) for r in rs]
        run_err = [abs(e) for r in rs for e in r["errors_per_run"]]
        ms = [m for m in meas if m["cfg"]["set"] == part]
        rule_scores = {rule: [m["rules"][rule] for m in ms if rule in m["rules"]] for rule in RULES}
        gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
        best_rule = min((r for r in RULES if len(rule_scores[r]) == len(ms)), key=lambda r: gm(rule_scores[r]))
        summary[part] = dict(
            configurations=len(ms),
            comparisons=len(rs),
            runs=runs,
            error_of_median=dict(
                median=statistics.median(med_err),
                p90=sorted(med_err)[int(0.9 * (len(med_err) - 1))],
                worst=max(med_err),
            ),
            error_per_run=dict(
                median=statistics.median(run_err),
                p90=sorted(run_err)[int(0.9 * (len(run_err) - 1))],
                worst=max(run_err),
            ),
            run_spread=dict(median=statistics.median(r["spread"] for r in rs), worst=max(r["spread"] for r in rs)),
            auto=dict(
                within_10pct=sum(m["auto_ratio"] <= 1.10 for m in ms),
                geomean=gm([m["auto_ratio"] for m in ms]),
                worst=max(m["auto_ratio"] for m in ms),
            ),
            best_rule=dict(
                rule=best_rule,
                within_10pct=sum(x <= 1.10 for x in rule_scores[best_rule]),
                geomean=gm(rule_scores[best_rule]),
                worst=max(rule_scores[best_rule]),
            ),
            rules={
                r: dict(geomean=gm(v), within_10pct=sum(x <= 1.10 for x in v), n=len(v))
                for r, v in rule_scores.items()
                if v
            },
        )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(
            dict(summary=summary, rows=rows, configs=[{k: v for k, v in m.items() if k != "runs"} for m in meas]),
            f,
            indent=1,
        )
    pct = lambda x: f"{x:.1%}"
    lines = [
        "# Cost model and `auto` vs the testbed, every run kept",
        "",
        f"Command: `sudo .venv/bin/python bench/evidence.py --runs {runs}`; raw runs in "
        f"`evidence_measurements.json`, re-report with `--from-json`. Machine: 2-core AMD EPYC VM, torch "
        f"{torch.__version__}, gloo over tc-shaped veth links (testbed), 1 thread per rank.",
        "",
    ]
    for part, s in summary.items():
        lines += [
            f"## {part} grid: {s['configurations']} configurations x strategies = {s['comparisons']} "
            f"comparisons, {s['runs']} independent runs each",
            "",
            f"- model error vs the median of the runs: median {pct(s['error_of_median']['median'])}, 90th "
            f"percentile {pct(s['error_of_median']['p90'])}, worst {pct(s['error_of_median']['worst'])}",
            f"- model error vs each run: median {pct(s['error_per_run']['median'])}, 90th percentile "
            f"{pct(s['error_per_run']['p90'])}, worst {pct(s['error_per_run']['worst'])}",
            f"- run-to-run spread (max-min)/median: median {pct(s['run_spread']['median'])}, worst "
            f"{pct(s['run_spread']['worst'])}",
            f"- `auto`: within 10% of the measured best in {s['auto']['within_10pct']}/{s['configurations']}, "
            f"geometric mean x{s['auto']['geomean']:.3f}, worst x{s['auto']['worst']:.3f}",
            f"- best fixed rule ({s['best_rule']['rule']}): within 10% in {s['best_rule']['within_10pct']}/"
            f"{s['configurations']}, geometric mean x{s['best_rule']['geomean']:.3f}, worst "
            f"x{s['best_rule']['worst']:.3f}",
            "- every rule: "
            + "; ".join(
                f"{r}: x{v['geomean']:.3f} ({v['within_10pct']}/{v['n']} within 10%)" for r, v in s["rules"].items()
            ),
            "",
        ]
    lines += [
        "| set | configuration | strategy | runs (ms) | median ms | spread | predicted ms | error | vs best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["strategy"] + (f" ({r['variant']})" if r["strategy"] == "auto" else "")
        lines.append(
            f"| {r['set']} | {r['key'].split('|', 1)[1].replace('|', ' ')} | {name} | "
            f"{', '.join(f'{t * 1e3:.0f}' for t in r['runs'])} | {r['median'] * 1e3:.1f} | {pct(r['spread'])} | "
            f"{r['predicted'] * 1e3:.1f} | {r['error_median']:+.1%} | x{r['vs_best']:.2f} |"
        )
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--grids", nargs="+", default=["held-out", "tuning"])
    ap.add_argument("--from-json", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument(
        "--plain",
        action="store_true",
        help="predict with the simulator's older plain variant "
        "(messages wait only for those of their own step, not for resources still busy with earlier "
        "steps'); writes evidence_plain.{md,json}",
    )
    a = ap.parse_args(argv)
    raw = os.path.join(a.out, "evidence_measurements.json")
    meas, ok = _results.measurements(a.from_json, "evidence")
    if not ok:
        return 2
    if meas is None:
        from tokenring.tools.bench import machine

        cfgs = (heldout_grid() if "held-out" in a.grids else []) + (tuning_grid() if "tuning" in a.grids else [])
        meas = []
        os.makedirs(a.out, exist_ok=True)
        if os.path.exists(raw):  # resume: keep finished configurations
            with open(raw) as f:
                meas = [m for m in json.load(f)["measurements"] if len(m["runs"]) >= a.runs]
        done = {key(m["cfg"]) for m in meas}
        for cfg in cfgs:
            if key(cfg) in done:
                continue
            t0 = time.time()
            runs = [measure_once(cfg, a) for _ in range(a.runs)]
            meas.append(dict(cfg=cfg, runs=runs))
            print(
                f"{key(cfg)}: "
                + "; ".join(f"{s} " + "/".join(f"{r[s]['time'] * 1e3:.0f}" for r in runs if s in r) for s in runs[0])
                + f" ms ({time.time() - t0:.0f} s)",
                flush=True,
            )
            with open(raw, "w") as f:
                json.dump(dict(machine=machine(), repeats=a.repeats, measurements=meas), f, indent=1)
    report(meas, predictor(a), a.out, max(len(m["runs"]) for m in meas), "evidence_plain" if a.plain else "evidence")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
