#!/usr/bin/env python3
"""``auto`` with a calibrated profile against every strategy measured, on the testbed (issue #30's evidence).

    sudo .venv/bin/python bench/calibration_evidence.py                       # measures (~45 min on 2 cores)
    .venv/bin/python bench/calibration_evidence.py --from-json bench/results/archive/calibration_measurements.json

For each testbed session (topology kind x link rate x P; namespaces rebuilt each session):
1. ``tokenring calibrate`` runs on the P ranks inside the testbed (``tokenring.tools.calibrate.run_local``): the
   profile, and the seconds it took;
2. every configuration of the session (MHA 8/8 or GQA 8/2, causal zigzag or not, forward or forward+backward;
   S=4096 at P=4, 4000 at P=5, d=64, float32) is measured with one ``tokenring bench`` run: warm-up, then
   ``--repeats`` rounds each timing one call of every strategy (order rotated), slowest rank, median kept and
   every round stored. The strategies: a fixed set (relay, direct c=1/c=2, ring, ring_bidir, Ulysses where it
   runs) plus whatever any scored model picks.

Scored models (``auto`` = the fastest prediction of the simulator over every candidate ``auto`` has):
- ``preset``: the README's way, ``set_topology("<kind>:<rate>mbit")`` with the built-in CPU kernel model;
- ``preset_2x_wrong``: the same with the kernel model deliberately 2x too fast (every rate doubled);
- ``calibrated``: the profile measured in step 1. Calibration replaces the kernel model with the measured one,
  so it is the same whichever model was set before it (the 2x-wrong one included).

Per configuration and model: measured time of the strategy the model picks / the best measured strategy; and the
same for the strategy it predicts fastest among those measured (what ``--refit`` can still score when newer
fitting picks a strategy the run did not measure).
Simulator error per measured strategy: predicted / measured - 1, for the preset and the calibrated profile.
Writes ``bench/results/calibration_measurements.json`` (every session, profile and round) and
``calibration_evidence.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402
import torch  # noqa: E402

from tokenring.layouts import default_layout  # noqa: E402
from tokenring.sim import get_topology, simulate  # noqa: E402
from tokenring.sim.auto import _kernel  # noqa: E402
from tokenring.sim.simulator import fastest, shapes_for, variant_candidates  # noqa: E402
from tokenring.sim.topology import topology_from_dict  # noqa: E402
from tokenring.strategies import why_not  # noqa: E402

FIXED = ("token_ring:relay", "token_ring:direct,c=1,k=1", "token_ring:direct,c=2,k=1", "ring", "ring_bidir", "ulysses")
CONFIGS = (  # (H, Hkv, causal, mode): each axis twice
    (8, 8, False, "fwd"),
    (8, 8, True, "both"),
    (8, 2, True, "fwd"),
    (8, 2, False, "both"),
)


def sessions(rates, kinds, P5_rate) -> list[dict]:
    out = [dict(kind=k, rate=r, P=4) for k in kinds for r in rates]
    out += [dict(kind=k, rate=P5_rate, P=5) for k in kinds] if P5_rate else []
    return out


def seq_for(P: int) -> int:
    return 4096 if P == 4 else 4000


def models(session: dict, profile: dict | None) -> dict:
    """name -> (topology, kernel model) for the scored models."""
    P = session["P"]
    preset = get_topology(f"{session['kind']}:{session['rate']:g}mbit", P)
    km = _kernel(preset, P)
    out = {
        "preset": (preset, km),
        "preset_2x_wrong": (preset, km.scaled(km.name + "-x2", 2.0, 2.0, "deliberately 2x too fast")),
    }
    if profile is not None:
        topo = topology_from_dict(profile)
        out["calibrated"] = (topo, topo.kernel)
    return out


def shapes(cfg, P):
    H, Hkv, causal, mode = cfg
    return shapes_for(S=seq_for(P), P=P, H=H, Hkv=Hkv, d=64, dtype=torch.float32), causal, mode


def predict(topo, km, sh, causal, mode, strategy) -> float:
    layout = default_layout(causal)
    return simulate(strategy, sh, topo, km, causal=causal, layout=layout, backward=mode == "both").time


def pick(topo, km, sh, causal, mode) -> str:
    layout = default_layout(causal)
    res = [
        simulate(n, sh, topo, km, causal=causal, layout=layout, backward=mode == "both")
        for n in variant_candidates("auto", sh, causal, layout)
    ]
    return fastest(res).strategy


def measure_session(session: dict, repeats: int, log) -> dict:
    from tokenring.tools import bench
    from tokenring.tools.calibrate import run_local
    from tokenring.tools.testbed import Testbed

    P = session["P"]
    out = dict(session, configs=[])
    with Testbed(P, session["kind"], rate_mbit=session["rate"]) as tb:
        kw = tb.launch_kwargs()
        t0 = time.perf_counter()
        profile = run_local(
            P, dict(seq=seq_for(P), heads=8, kv_heads=8, head_dim=64, dtype="float32", repeats=3), timeout=120, **kw
        )
        out["calibrate_wall_s"] = time.perf_counter() - t0
        out["profile"] = profile
        log(
            f"  calibrated in {profile['measured']['total_s']:.1f} s (wall {out['calibrate_wall_s']:.1f} s): "
            f"{profile['topology']['source']}"
        )
        ms = models(session, profile)
        for cfg in CONFIGS:
            sh, causal, mode = shapes(cfg, P)
            picks = {name: pick(t, k, sh, causal, mode) for name, (t, k) in ms.items()}
            strategies = [s for s in FIXED if why_not(s.split(":")[0], cfg[0], cfg[1], P) is None]
            strategies += [s for s in picks.values() if s not in strategies]
            spec = bench.make_spec(
                P=P,
                S=seq_for(P),
                H=cfg[0],
                Hkv=cfg[1],
                d=64,
                dtype="float32",
                causal=causal,
                mode=mode,
                strategies=strategies,
                warmup=1,
                repeats=repeats,
                trace=False,
                comm_only=False,
            )
            t0 = time.perf_counter()
            res = bench.run(spec, **kw)
            rows = {
                r["strategy"]: dict(time=r["time"], times=r["times"], check=r.get("check"))
                for r in res["results"]
                if "time" in r
            }
            out["configs"].append(dict(H=cfg[0], Hkv=cfg[1], causal=causal, mode=mode, measured=rows, picks=picks))
            best = min(rows, key=lambda n: rows[n]["time"])
            log(
                f"  H={cfg[0]}/{cfg[1]} causal={causal} {mode}: best {best} {rows[best]['time'] * 1e3:.0f} ms; "
                + ", ".join(f"{m}->{p} {rows[p]['time'] / rows[best]['time']:.2f}x" for m, p in picks.items())
                + f" ({time.perf_counter() - t0:.0f} s)"
            )
        out["dropped_packets"] = tb.dropped()
    out["machine"] = bench.machine()
    return out


def score(data: dict) -> dict:
    """Per model: auto's ratio to the best measured, per configuration; simulator errors per strategy."""
    rows, errors = [], {}
    for sess in data["sessions"]:
        ms = models(sess, sess.get("profile"))
        for c in sess["configs"]:
            cfg = (c["H"], c["Hkv"], c["causal"], c["mode"])
            sh, causal, mode = shapes(cfg, sess["P"])
            meas = {n: v["time"] for n, v in c["measured"].items()}
            best = min(meas.values())
            row = dict(
                kind=sess["kind"],
                rate=sess["rate"],
                P=sess["P"],
                H=c["H"],
                Hkv=c["Hkv"],
                causal=causal,
                mode=mode,
                best=min(meas, key=meas.get),
                best_ms=best * 1e3,
            )
            for name, (topo, km) in ms.items():
                p = pick(topo, km, sh, causal, mode)
                pred = {n: predict(topo, km, sh, causal, mode, n) for n in meas}
                among = min(pred, key=pred.get)  # scorable when a refit picks a strategy the run did not measure
                row[name] = dict(
                    pick=p, ratio=meas[p] / best if p in meas else None, among=among, among_ratio=meas[among] / best
                )
                for n, t in meas.items():
                    errors.setdefault(name, []).append(
                        dict(
                            config=row["kind"] + f":{sess['rate']:g}/P{sess['P']}/{c['H']}-{c['Hkv']}"
                            f"/{'c' if causal else 'nc'}/{mode}",
                            strategy=n,
                            error=pred[n] / t - 1,
                        )
                    )
            if "calibrated" in ms:  # where the configuration sits: the calibrated model's regime for the best
                topo, km = ms["calibrated"]
                layout = default_layout(causal)
                row["regime"] = simulate(
                    row["best"], sh, topo, km, causal=causal, layout=layout, backward=mode == "both"
                ).regime
            rows.append(row)
    summary = {}
    for name in ("preset", "preset_2x_wrong", "calibrated"):
        ratios = [r[name]["ratio"] for r in rows if name in r and r[name]["ratio"] is not None]
        unmeasured = sum(1 for r in rows if name in r and r[name]["ratio"] is None)
        errs = [abs(e["error"]) for e in errors.get(name, [])]
        if not ratios:
            continue
        among = [r[name]["among_ratio"] for r in rows if name in r]
        summary[name] = dict(
            among_measured_within_5pct=sum(x <= 1.05 for x in among),
            among_measured_worst=max(among),
            configs=len(ratios),
            within_5pct=sum(x <= 1.05 for x in ratios),
            share_within_5pct=sum(x <= 1.05 for x in ratios) / len(ratios),
            worst=max(ratios),
            median=statistics.median(ratios),
            unmeasured_picks=unmeasured,
            sim_abs_error_median=statistics.median(errs),
            sim_abs_error_p90=sorted(errs)[int(0.9 * (len(errs) - 1))],
            sim_abs_error_worst=max(errs),
        )
    cal = [s["profile"]["measured"]["total_s"] for s in data["sessions"] if s.get("profile")]
    # how far apart one strategy's rounds are: the resolution of "within 5%"
    spreads = [
        (max(v["times"]) - min(v["times"])) / v["time"]
        for s in data["sessions"]
        for c in s["configs"]
        for v in c["measured"].values()
    ]
    for name in summary:
        summary[name]["round_spread_median"] = statistics.median(spreads)
    return dict(rows=rows, errors=errors, summary=summary, calibrate_seconds=cal)


def report(data: dict, scored: dict) -> str:
    m = data["sessions"][0]["machine"] if data["sessions"] else {}
    lines = [
        "# `auto` with a calibrated profile on the testbed",
        "",
        f"Machine: {m.get('cpu')} ({m.get('cores')} cores), torch {m.get('torch')}, host `{m.get('host')}`. "
        f"Command: `{data['command']}`. Every round is in "
        f"`{os.path.basename(data.get('out', 'calibration_measurements.json'))}`.",
        "",
        "| model | configs | auto within 5% of best | median ratio | worst ratio | best predicted among the measured: "
        "within 5%, worst | sim error median | p90 | worst |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in scored["summary"].items():
        n = len(scored["rows"])
        lines.append(
            f"| {name} | {s['configs']} | {s['within_5pct']} ({s['share_within_5pct']:.0%}) | {s['median']:.3f} | "
            f"{s['worst']:.3f} | {s['among_measured_within_5pct']}/{n}, {s['among_measured_worst']:.3f} | "
            f"{s['sim_abs_error_median']:.1%} | {s['sim_abs_error_p90']:.1%} | {s['sim_abs_error_worst']:.1%} |"
        )
    spread = next(iter(scored["summary"].values()), {}).get("round_spread_median")
    if spread is not None:
        lines += [
            "",
            f"One strategy's {len(data['sessions'][0]['configs'][0]['measured'][scored['rows'][0]['best']]['times'])} "
            f"rounds span {spread:.1%} of their median (median over every strategy and configuration).",
        ]
    cs = scored["calibrate_seconds"]
    if cs:
        lines += ["", f"`calibrate` took {min(cs):.1f}-{max(cs):.1f} s per session (P=4 and 5)."]
    lines += [
        "",
        "| topology | P | heads | causal | pass | best (ms) | regime | preset pick | ratio | 2x-wrong pick | ratio | "
        "calibrated pick | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in scored["rows"]:
        cells = []
        for name in ("preset", "preset_2x_wrong", "calibrated"):
            x = r.get(name)
            cells += [x["pick"], f"{x['ratio']:.3f}" if x and x["ratio"] else "-"] if x else ["-", "-"]
        lines.append(
            f"| {r['kind']}:{r['rate']:g}mbit | {r['P']} | {r['H']}/{r['Hkv']} | {r['causal']} | {r['mode']} | "
            f"{r['best']} {r['best_ms']:.0f} | {r.get('regime', '-')} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[150.0, 300.0, 600.0], help="Mbit/s, P=4 sessions")
    ap.add_argument("--kinds", nargs="+", default=["mesh", "ring", "switch"])
    ap.add_argument("--p5-rate", type=float, default=300.0, help="rate of the P=5 sessions (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--from-json", default=None)
    ap.add_argument(
        "--refit",
        action="store_true",
        help="fit each session's stored calibration measurements again with this version of tokenring.calibrate",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results", "calibration_measurements.json"))
    ap.add_argument("--stem", default="calibration_evidence", help="name of the report in bench/results/")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            data = json.load(f)
    else:
        data = dict(
            command="sudo .venv/bin/python bench/calibration_evidence.py " + " ".join(sys.argv[1:]), sessions=[]
        )
        if os.path.exists(a.out):  # resume: keep the sessions already measured
            with open(a.out) as f:
                data["sessions"] = json.load(f)["sessions"]
        done = {(s["kind"], s["rate"], s["P"]) for s in data["sessions"]}
        for sess in sessions(a.rates, a.kinds, a.p5_rate):
            if (sess["kind"], sess["rate"], sess["P"]) in done:
                continue
            print(f"{sess['kind']} {sess['rate']:g} Mbit/s P={sess['P']}", flush=True)
            data["sessions"].append(measure_session(sess, a.repeats, lambda s: print(s, flush=True)))
            with open(a.out, "w") as f:
                json.dump(data, f)
    data.setdefault("out", a.from_json or a.out)
    if a.refit:
        from tokenring.calibration import refit

        for sess in data["sessions"]:
            sess["profile"] = refit(sess["profile"]).to_dict()
        data["command"] += " (profiles refitted: --from-json ... --refit)"
    scored = score(data)
    summary = dict(
        command=data["command"],
        summary=scored["summary"],
        rows=scored["rows"],
        calibrate_seconds=scored["calibrate_seconds"],
    )
    stem = a.stem + ("_refit" if a.refit else "")
    _results.write(os.path.join(HERE, "results", stem), summary, report(data, scored).splitlines())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
