#!/usr/bin/env python3
"""TokenRing's variants against every other strategy on the interconnect testbed, per call, in one command
(needs root; about 50 minutes on 2 cores):

    sudo .venv/bin/python bench/token_ring_wins.py            # writes bench/results/token_ring_wins.{md,json}
    sudo .venv/bin/python bench/token_ring_wins.py --quick    # one topology, forward only: a smoke run

1. Calibrate on unshaped local ranks: one forward block's compute ``C`` at the case shape (ring's median compute
   per step); the *comm-bound* link rate is the one at which ring's K/V message per step takes ``2C``.
2. Compute floors, per (heads, mask, pass): ``P`` blocks of compute of ring on unshaped links (the sum of the
   slowest rank's computes per call), measured in this run.
3. At the comm-bound rate, on ``mesh``, ``ring`` (neighbour links only) and ``switch``: MHA (H=8) and GQA (H=8,
   Hkv=2), causal (zigzag) and not, forward; causal forward+backward; every strategy side by side: ring,
   ring_bidir, ulysses, PyTorch's private ring, the paper's TokenRing (``token_ring_paper``), ``token_ring`` (the
   variant the cost model picks for the testbed), a fixed direct TokenRing, ``ring:auto`` and ``auto``.
3b. The same strategies on unshaped local ranks (no namespaces, no shaping), per (heads, mask, pass): what each
   costs on this host when links cost nothing but the CPU that moves their bytes. No strategy can run faster
   on shaped links, so ``ring (shaped) / token_ring (unshaped)`` bounds what a ratio goal can reach here.
4. A rate sweep (MHA forward, mesh) from 0.5x to 4x the comm-bound rate.
4b. GQA at *its* comm-bound rate (K/V per step is Hkv/H of MHA's, so the rate scales by Hkv/H), mesh, forward,
   with explicit direct pass-KV variants (``--gqa-only`` reruns just this part into an existing result).
5. P = 5 (``--odd-only`` reruns just this part): its own calibration and floors, MHA (H=10) non-causal and
   causal forward, causal forward+backward, on the three topologies.
6. The simulator's prediction of every measured variant (model frozen before the run; also with FIFO sharing
   between connections, and for one GQA variant without ready notices / with late receives) and ``auto``'s
   pick scored against the measured best.
6b. Many interleaved rounds of ring, ulysses and the TokenRing variants in the goal case (MHA non-causal
   forward, mesh; ``--duel`` reruns just this part): paired ratios with confidence intervals.
7. What the host costs: the model on the kept mesh MHA measurements with the host's work per byte removed
   (``--report-only --what-if`` adds it to an existing result, measuring nothing).
No number in the outputs is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from math import comb
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # a fresh clone works without installing

from tokenring.tools import bench, testbed  # noqa: E402

P, S, H, D = 4, 4096, 8, 64
FIXED_DIRECT = "token_ring:direct,c=2,k=3"
STRATEGIES = [
    "ring",
    "ring_bidir",
    "ulysses",
    "pytorch_ring",
    "token_ring_paper",
    "token_ring",
    FIXED_DIRECT,
    "ring:auto",
    "auto",
]
GQA_KV = 2
GQA_STRATEGIES = [
    "ring",
    "ring_bidir",
    "ulysses",
    "pytorch_ring",
    "token_ring",
    "token_ring:direct,c=4,k=3",
    "ring:direct,c=1,k=3",
    "ring:direct,c=2,k=3",
    "ring:direct,c=2,k=1",
    "ring:auto",
    "auto",
]
# The many-rounds comparison of the goal case (--duel)
DUEL = ["ring", "ulysses", "token_ring", FIXED_DIRECT]
# Whose prediction the report shows with and without the model's ready notices (see notice_rows)
NOTICE_CASE = ("token_ring:direct,c=4,k=3", True)
# Odd P: a bye round per chunk sweep in the direct schedules; H divisible by P for Ulysses
ODD_P, ODD_H = 5, 10
ODD_STRATEGIES = [
    "ring",
    "ring_bidir",
    "ulysses",
    "token_ring_paper",
    "token_ring",
    "token_ring:direct,c=2,k=4",
    "ring:auto",
    "auto",
]
TRACED = ("ring", "token_ring_paper", "token_ring", "ulysses")
WHAT_IF = ("ring", "ulysses", "token_ring")  # what_if's strategies
# Unshaped runs: every strategy above, and direct variants with one chunk and with four (the bounds need each
# chunking's links-free time).
UNSHAPED = list(
    dict.fromkeys(
        STRATEGIES + GQA_STRATEGIES + ["token_ring:direct,c=1,k=3", "token_ring:direct,c=4,k=3", "ring:direct,c=4,k=3"]
    )
)


def ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def by_name(res: dict) -> dict:
    return {r["strategy"]: r for r in res["results"]}


def round_ratios(res: dict, a: str, b: str) -> list[float] | None:
    """``time_b / time_a`` per round (interleaved runs time one call of every strategy per round; above 1:
    ``a`` was faster); ``None`` for sequential runs, whose repeats do not pair."""
    rs = by_name(res)
    if not res["spec"].get("interleave") or "times" not in rs.get(a, {}) or "times" not in rs.get(b, {}):
        return None
    return [y / x for x, y in zip(rs[a]["times"], rs[b]["times"])]


def paired(res: dict, a: str, b: str) -> str:
    """``b`` against ``a`` round by round: the median over rounds of ``time_b / time_a`` and in how many rounds
    ``a`` was faster; ``-`` for sequential runs."""
    ratios = round_ratios(res, a, b)
    if ratios is None:
        return "-"
    return f"{median(ratios):.2f}x ({sum(x > 1 for x in ratios)}/{len(ratios)})"


def sign_test(won: int, n: int) -> float:
    """Two-sided sign-test p-value of ``won`` wins in ``n`` paired rounds under "neither is faster"."""
    tail = sum(comb(n, i) for i in range(min(won, n - won) + 1)) / 2**n
    return min(1.0, 2 * tail)


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median of ``xs`` (order statistics j and n - 1 - j, where
    the binomial(n, 1/2) tail below j is at most (1 - level) / 2)."""
    xs, n = sorted(xs), len(xs)
    j, acc = 0, 0.0
    while j < n // 2 and acc + comb(n, j) / 2**n <= (1 - level) / 2:
        acc += comb(n, j) / 2**n
        j += 1
    j = max(0, j - 1)
    return xs[j], xs[n - 1 - j]


def duel(repeats: int) -> dict:
    """The non-causal MHA forward case on the mesh at the comm-bound rate with many interleaved rounds of only
    ring, ulysses and the TokenRing variants: enough pairs to tell a small difference from the machine's noise.
    Calibrated on its own (it may run on another machine than the rest of the report)."""
    cal = calibrate(7)
    rate = cal["rate_mbit"]
    spec = bench.make_spec(
        P=P, S=S, H=H, Hkv=H, d=D, causal=False, mode="fwd", strategies=DUEL, repeats=repeats, warmup=1, trace=False
    )
    with testbed.Testbed(P, "mesh", rate) as tb:
        res = bench.run(spec, **tb.launch_kwargs())
        res["testbed"] = dict(tb.describe(), dropped=tb.dropped())
    res["date"] = time.strftime("%Y-%m-%d %H:%M")
    res["calibration"], res["machine"] = cal, bench.machine()
    return bench.strip_events(res)


def duel_rows(res: dict | None) -> list[str]:
    if not res:
        return []
    rs, m, cal = by_name(res), res["machine"], res["calibration"]
    L = [
        "",
        "## Many rounds: token_ring against ulysses (mesh, MHA, non-causal, fwd)",
        "",
        f"`sudo .venv/bin/python bench/token_ring_wins.py --duel` (a part of the full run too) on {res['date']}, "
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; its own calibration: one forward block = "
        f"{ms(cal['block_compute_s'])} ms, comm-bound rate {cal['rate_mbit']:g} Mbit/s. Only "
        f"{', '.join(DUEL)}, {len(rs['ring']['times'])} interleaved rounds at {res['testbed']['rate_mbit']:g} "
        "Mbit/s, same shapes as above. Paired = median over rounds of ulysses' time / the variant's, with its 95% "
        "distribution-free confidence interval; won = rounds in which the variant was faster, and the two-sided "
        "sign-test p-value of that count if neither were faster.",
        "",
        "| strategy | ran | median ms [min-max] | ring / it | paired ulysses / it [95% CI] | won | sign test p |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in DUEL:
        r = rs[n]
        row = (
            f"| {n} | {r.get('variant', n)} | {ms(r['time'])} [{ms(r['time_min'])}-{ms(r['time_max'])}] | "
            f"{rs['ring']['time'] / r['time']:.2f}x | "
        )
        if n in ("ring", "ulysses"):
            L.append(row + "- | - | - |")
            continue
        ratios = round_ratios(res, n, "ulysses")
        lo, hi = median_ci(ratios)
        won = sum(x > 1 for x in ratios)
        L.append(
            row + f"{median(ratios):.3f}x [{lo:.3f}-{hi:.3f}] | {won}/{len(ratios)} | "
            f"{sign_test(won, len(ratios)):.2g} |"
        )
    return L


def calibrate(repeats: int, P: int = P, H: int = H) -> dict:
    """Forward block compute on unshaped local ranks and the rate at which ring's K/V per step takes 2x it
    (``S // P`` = 1024 rows per rank at every ``P``)."""
    S = 1024 * P
    res = bench.run(bench.make_spec(P=P, S=S, H=H, d=D, strategies=["ring"], repeats=repeats, comm_only=False))
    c = by_name(res)["ring"]["compute_per_step"]
    kv = 2 * (S // P) * H * D * 4
    rate = kv * 8 / (2 * c) / 1e6
    return dict(block_compute_s=c, kv_bytes_per_step=kv, exact_rate_mbit=rate, rate_mbit=max(10, round(rate / 10) * 10))


def floor(Hkv: int, causal: bool, mode: str, repeats: int, P: int = P, H: int = H) -> dict:
    """P blocks of compute (ring's computes, slowest rank per step, summed) on unshaped local ranks: the lower
    of two runs (``floor``; both in ``runs``), since a floor is a bound and the shared cores only add time."""
    runs = [
        bench.compute_floor(P=P, S=1024 * P, H=H, Hkv=Hkv, d=D, causal=causal, mode=mode, repeats=repeats)
        for _ in range(2)
    ]
    return dict(floor=min(runs), runs=runs)


def unshaped(Hkv: int, causal: bool, mode: str, repeats: int) -> dict:
    """Every strategy of the grid on unshaped local ranks (the links-free time of each, on this host)."""
    res = bench.run(
        bench.make_spec(
            P=P,
            S=S,
            H=H,
            Hkv=Hkv,
            d=D,
            causal=causal,
            mode=mode,
            strategies=UNSHAPED,
            repeats=repeats,
            warmup=1,
            trace=False,
            comm_only=False,
        )
    )
    return bench.strip_events(res)


def model_inputs(res: dict) -> tuple:
    """What the model needs to predict a kept measurement: ``(shapes, topology, kernel model, simulate's
    keyword arguments)``, with the run's torch threads set (the CPU kernel model follows them)."""
    import torch

    from tokenring.schedules import Shapes
    from tokenring.sim import get_topology
    from tokenring.sim.auto import _kernel

    sp, tb = res["spec"], res["testbed"]
    sh = Shapes(sp["B"], sp["S"] // sp["P"], sp["H"], sp["Hkv"], sp["d"], getattr(torch, sp["dtype"]), sp["P"])
    topo = get_topology(f"{tb['topology']}:{tb['rate_mbit']:g}mbit", sp["P"])
    torch.set_num_threads(sp["threads"])
    return (
        sh,
        topo,
        _kernel(topo, sp["P"]),
        dict(causal=sp["causal"], layout=sp["layout"], backward=sp["pass"] != "fwd"),
    )


def predict(res: dict) -> dict:
    """The frozen model's prediction per measured strategy (its resolved variant) and what auto would pick."""
    from dataclasses import replace

    from tokenring.sim import simulate
    from tokenring.sim.auto import choose

    sp = res["spec"]
    sh, topo, km, kw = model_inputs(res)
    out, fifo = {}, {}
    for r in res["results"]:
        name = r.get("variant")
        if "time" in r and name:
            out[r["strategy"]] = simulate(name, sh, topo, km, **kw).time
            # the model with FIFO sharing between connections (as before fair_share), for the comparison
            fifo[r["strategy"]] = simulate(name, sh, replace(topo, fair_share=False), km, **kw).time
    out["fifo"] = fifo
    out["auto_pick"] = choose(sh, sp["causal"], sp["layout"], kw["backward"], "cpu", topo)[0]
    name, causal = NOTICE_CASE
    if sp["causal"] == causal and sp["Hkv"] != sp["H"] and any(r.get("variant") == name for r in res["results"]):
        # the same variant, the model without ready notices, and with them but every receive posted with its
        # message (what the executor did before early receives)
        out["notice"] = dict(
            variant=name,
            model=out.get(next(r["strategy"] for r in res["results"] if r.get("variant") == name)),
            no_notice=simulate(name, sh, replace(topo, ready_notice=False), km, **kw).time,
            late_receives=simulate(name, sh, topo, km, early=False, **kw).time,
        )
    return out


def what_if(res: dict) -> dict:
    """The model on one kept measurement, three ways: the testbed as it is; the same shaped links with the host's
    work per byte removed (no CPU time per byte sent or received, no loopback cap: transfers that leave the
    computing cores alone, as DMA engines move a GPU's data); and links free as well (ring then gives the modelled
    floor: P blocks and their merges). ``token_ring`` is the family choice: the variant the model picks under
    each. Milliseconds; the variant beside each."""
    from dataclasses import replace

    from tokenring.sim import simulate
    from tokenring.sim.topology import INF

    sh, topo, km, kw = model_inputs(res)
    host_free = replace(topo, cpu_per_byte=0.0, backplane_bw=INF)
    out = {}
    for label, t in (("testbed", topo), ("host_free", host_free)):
        runs = {n: simulate(n, sh, t, km, **kw) for n in WHAT_IF}
        out[label] = {n: [r.time * 1e3, r.strategy] for n, r in runs.items()}
    out["floor_ms"] = simulate("ring", sh, replace(host_free, link_bw=INF, latency=0.0), km, **kw).time * 1e3
    return out


def what_if_rows(all_res: dict) -> list[str]:
    """The report section: measured ratios beside the model's, with and without the host's work per byte."""
    odd = all_res.get("odd") or {}
    rows = [(r, all_res["floors"]) for r in all_res["cases"] + all_res["sweep"] if "what_if" in r]
    rows += [(r, odd["floors"]) for r in odd_cases(all_res) if "what_if" in r]
    if not rows:
        return []
    L = [
        "",
        "## What the host costs TokenRing: the model without the host's work per byte",
        "",
        "Here every byte a rank sends or receives also costs the two cores that compute (kernel TCP stack, veth, "
        "gloo). A TokenRing overlaps its transfers with compute, so its bytes slow its compute (the breakdown at "
        f"the end: compute per rank grows while links are busy), and at P={P} it moves twice Ulysses' bytes "
        "(per rank: P-1 query blocks out and P-1 partials back, against Ulysses' 4(P-1)/P block-sized pieces), "
        "while Ulysses moves its bytes while the cores wait for them. A GPU's copy engines move bytes without its "
        "SMs (the model's GPU topologies charge no compute per byte). The validated model, on each kept mesh "
        "measurement, three ways: as the testbed is; the same shaped links with the host's per-byte work removed "
        "(`cpu_per_byte = 0`, no loopback cap); links free too (ring then gives the modelled floor). Ratios as "
        "in the tables above (ring / token_ring, ulysses / token_ring, token_ring / floor); "
        f"`{all_res.get('what_if_by', 'sudo .venv/bin/python bench/token_ring_wins.py')}`"
        + (f" on {all_res['what_if_date']}" if "what_if_date" in all_res else "")
        + ".",
        "",
        "| P | Mbit/s | case | measured: vs ring | vs ulysses | / floor | model, testbed: vs ring | vs ulysses "
        "| / floor | model, host work removed: token_ring runs | ms | vs ring | vs ulysses | / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res, floors in rows:
        sp, rs, w = res["spec"], by_name(res), res["what_if"]
        fl = floors[f"{sp['Hkv']}-{sp['causal']}-{sp['pass']}"]["floor"]
        tr = rs["token_ring"]["time"]
        cells = [f"{rs['ring']['time'] / tr:.2f}x", f"{rs['ulysses']['time'] / tr:.2f}x", f"{tr / fl:.2f}"]
        for label in ("testbed", "host_free"):
            m = {n: v[0] for n, v in w[label].items()}
            if label == "host_free":
                cells += [f"`{w[label]['token_ring'][1]}`", f"{m['token_ring']:.1f}"]
            cells += [
                f"{m['ring'] / m['token_ring']:.2f}x",
                f"{m['ulysses'] / m['token_ring']:.2f}x",
                f"{m['token_ring'] / w['floor_ms']:.2f}",
            ]
        L.append(f"| {sp['P']} | {res['testbed']['rate_mbit']:g} | {shape_label(sp)} | " + " | ".join(cells) + " |")
    return L


def run_case(
    tag: str,
    topo: str,
    rate: float,
    Hkv: int,
    causal: bool,
    mode: str,
    strategies,
    repeats: int,
    outdir: str,
    traces: bool,
    P: int = P,
    H: int = H,
) -> dict:
    spec = bench.make_spec(
        P=P,
        S=1024 * P,
        H=H,
        Hkv=Hkv,
        d=D,
        causal=causal,
        mode=mode,
        strategies=strategies,
        repeats=repeats,
        warmup=1,
        trace=traces,
    )
    with testbed.Testbed(P, topo, rate) as tb:
        res = bench.run(spec, **tb.launch_kwargs())
        res["testbed"] = dict(tb.describe(), dropped=tb.dropped())
    res["case"] = tag
    if traces:
        for r in res["results"]:
            if r["strategy"] not in TRACED:
                r.pop("trace_events", None)
        bench.write_traces(res, outdir, tag=f"tr_{tag}_{topo}_")
    res = bench.strip_events(res)
    res["predicted"] = predict(res)
    if topo == "mesh" and Hkv == H:
        res["what_if"] = what_if(res)
    return res


def odd_cases(all_res: dict) -> list[dict]:
    return (all_res.get("odd") or {}).get("cases", [])


def shape_label(sp: dict) -> str:
    heads = "MHA" if sp["H"] == sp["Hkv"] else f"GQA {sp['H']}/{sp['Hkv']}"
    return f"{heads}, {'causal' if sp['causal'] else 'non-causal'}, {'fwd' if sp['pass'] == 'fwd' else 'fwd+bwd'}"


def write(all_res: dict, outdir: str) -> None:
    cal, floors, cases, sweep = all_res["calibration"], all_res["floors"], all_res["cases"], all_res["sweep"]
    gqa = all_res.get("gqa", [])
    m = all_res["machine"]
    L = [
        "# TokenRing that wins per call: direct, fine-grained schedules on the testbed",
        "",
        f"Generated by `sudo .venv/bin/python bench/token_ring_wins.py` on {all_res['date']}. Machine: {m['cpu']}, "
        f"{m['cores']} cores, torch {m['torch']}, gloo, no GPU. P={P} ranks (one thread each, sharing the cores), "
        f"S={S}, H={H}, d={D}, float32, B=1. Links: `tc tbf` per direction with 64 KB frames (`tokenring testbed`)."
        + "".join(
            f" Measured again on {x['date']} by `{x['command']}`: the {x['part']}." for x in all_res.get("reruns", [])
        ),
        "",
        f"Calibration (unshaped): one forward block = {ms(cal['block_compute_s'])} ms; ring's K/V per step = "
        f"{cal['kv_bytes_per_step'] / 1e6:.2f} MB, which takes 2x a block at {cal['exact_rate_mbit']:.0f} Mbit/s: "
        f"**comm-bound rate {cal['rate_mbit']:g} Mbit/s** per link direction.",
        "",
        "Each cell: median ms per call over the repeats (slowest rank) and [min-max] over them (every repeat "
        "is in the JSON"
        + (
            f"; {all_res['repeats']} repeats per cell, {all_res['switch_repeats']} on the switch, whose cells "
            f"spread the most"
            if "repeats" in all_res
            else ""
        )
        + "), ratio = ring / strategy (higher is faster than ring). Floor = P blocks of compute on "
        "unshaped links (same shapes, same run; the lower of two runs, both in the JSON). "
        "`token_ring` = the variant the cost model picks for the testbed (named below the table)."
        + (
            " The strategies of a cell ran in interleaved rounds (one call of each per round, the order rotated), "
            "so round i of two strategies is a pair: *paired* = the median over rounds of ulysses' time / "
            "token_ring's (robust to a drift of the machine during the cell), and in how many rounds token_ring "
            "was the faster."
            if cases and cases[0]["spec"].get("interleave")
            else ""
        ),
        "",
    ]
    names = [n for n in STRATEGIES]
    L.append(
        "| topology | case | floor ms | " + " | ".join(names) + " | best | token_ring vs ring | "
        "token_ring vs ulysses | token_ring vs ulysses, paired (won) | token_ring / floor |"
    )
    L.append("|" + "---|" * (len(names) + 8))
    for res in cases:
        sp, rs = res["spec"], by_name(res)
        fl = floors[f"{sp['Hkv']}-{sp['causal']}-{sp['pass']}"]["floor"]
        cells = []
        for n in names:
            r = rs.get(n)
            cells.append(
                "skip" if r is None or "time" not in r else f"{ms(r['time'])} [{ms(r['time_min'])}-{ms(r['time_max'])}]"
            )
        timed = {n: r["time"] for n, r in rs.items() if "time" in r}
        best = min(timed, key=timed.get)
        tr, ring, uly = timed.get("token_ring"), timed.get("ring"), timed.get("ulysses")
        L.append(
            f"| {res['testbed']['topology']} | {shape_label(sp)} | {ms(fl)} | "
            + " | ".join(cells)
            + f" | {best} | {ring / tr:.2f}x | "
            + (f"{uly / tr:.2f}x" if uly else "-")
            + f" | {paired(res, 'token_ring', 'ulysses')} | {tr / fl:.2f} |"
        )
    L += ["", "Variants that ran for the family names (chosen on rank 0 by the cost model for the testbed):", ""]
    L.append("| topology | case | token_ring ran | ring:auto ran | auto ran |")
    L.append("|---|---|---|---|---|")
    for res in cases:
        rs = by_name(res)
        L.append(
            f"| {res['testbed']['topology']} | {shape_label(res['spec'])} | "
            + " | ".join(rs[n].get("variant", "-") for n in ("token_ring", "ring:auto", "auto"))
            + " |"
        )
    free = all_res.get("unshaped", {})
    if free:
        cols = [
            "ring",
            "ulysses",
            "token_ring_paper",
            "token_ring:direct,c=1,k=3",
            FIXED_DIRECT,
            "token_ring:direct,c=4,k=3",
            "ring:direct,c=1,k=3",
            "ring:direct,c=2,k=3",
            "ring:direct,c=4,k=3",
        ]
        L += [
            "",
            "## Links free: the same strategies unshaped, and the ratios this host allows",
            "",
            "Unshaped local ranks (loopback, no namespaces), same shapes, one run per row. Moving a byte still "
            "costs the two shared cores (kernel TCP stack, gloo), so a strategy's unshaped time bounds its time "
            "over any shaped link here from below. Bound = ring on that topology at the comm-bound rate / the "
            "fastest unshaped direct variant with c >= 2 chunks (TokenRing for MHA; pass-KV for the GQA row of "
            "its own section). Why c >= 2: at the comm-bound rate one block's queries (half of ring's K/V "
            "message) take one block's compute C to cross a link, so with c = 1 the first visiting block "
            "arrives after C and the last partial needs C to return, 2C that the own block (C) cannot hide; "
            "with c >= 2 they take C/c each and the split own block can hide both. The paper's relay is capped "
            "at 2(P-1)/(P+1) = 1.2x by its P+1 phases.",
            "",
            "| case | floor ms | " + " | ".join(cols) + " | best TokenRing c>=2 / floor | bound vs ring: mesh | "
            "ring | switch |",
            "|" + "---|" * (len(cols) + 6),
        ]

        def best_free(rs: dict, family: str) -> float:
            return min(
                r["time"]
                for n, r in rs.items()
                if n.startswith(family + ":direct") and int(n.split("c=")[1].split(",")[0]) >= 2
            )

        for key, res in free.items():
            rs = {n: r for n, r in by_name(res).items() if "time" in r}
            tr = best_free(rs, "token_ring")
            bounds = []
            for topo in ("mesh", "ring", "switch"):
                ring = [
                    by_name(c)["ring"]["time"]
                    for c in cases
                    if c["testbed"]["topology"] == topo
                    and f"{c['spec']['Hkv']}-{c['spec']['causal']}-{c['spec']['pass']}" == key
                ]
                bounds.append(f"{ring[0] / tr:.2f}x" if ring else "-")
            L.append(
                f"| {shape_label(res['spec'])} | {ms(floors[key]['floor'])} | "
                + " | ".join(ms(rs[n]["time"]) if n in rs else "skip" for n in cols)
                + f" | {tr / floors[key]['floor']:.2f} | "
                + " | ".join(bounds)
                + " |"
            )
        for res in gqa:
            key = f"{GQA_KV}-{res['spec']['causal']}-fwd"
            if key in free:
                rs = {n: r for n, r in by_name(free[key]).items() if "time" in r}
                kv = best_free(rs, "ring")
                L += [
                    "",
                    f"GQA section ({shape_label(res['spec'])}, mesh at {res['testbed']['rate_mbit']:g} Mbit/s): "
                    f"ring {ms(by_name(res)['ring']['time'])} ms / fastest unshaped direct pass-KV with c >= 2 "
                    f"{ms(kv)} ms = bound **{by_name(res)['ring']['time'] / kv:.2f}x**; floor "
                    f"{ms(floors[key]['floor'])} ms.",
                ]
    # model validation
    errs, rows, auto_ok, auto_n, auto_ours, fifo_errs = [], [], 0, 0, 0, []
    for res in cases + sweep + gqa + odd_cases(all_res):
        rs, pred = by_name(res), res["predicted"]
        timed = {n: r["time"] for n, r in rs.items() if "time" in r}
        best = min(timed.values())
        for n, t in timed.items():
            if n in pred:
                e = pred[n] / t - 1
                errs.append(abs(e))
                ef = pred["fifo"][n] / t - 1 if n in pred.get("fifo", {}) else None
                if ef is not None:
                    fifo_errs.append(abs(ef))
                rows.append(
                    (
                        res["testbed"]["topology"],
                        res["testbed"]["rate_mbit"],
                        shape_label(res["spec"]),
                        rs[n].get("variant", n),
                        t,
                        pred[n],
                        e,
                        ef,
                        res["spec"]["P"],
                    )
                )
        pick = pred["auto_pick"]
        got = [r["time"] for r in rs.values() if r.get("variant") == pick and "time" in r]
        ours = min(t for n, t in timed.items() if not n.startswith("pytorch"))  # what auto can choose from
        if got:
            auto_n += 1
            auto_ok += min(got) <= 1.05 * best
            auto_ours += min(got) <= 1.05 * ours
    errs.sort()
    L += [
        "",
        "## Simulator against these measurements",
        "",
        f"{len(errs)} predictions (the model as committed"
        + (
            f", re-predicted on {all_res['date_predicted']} by `{all_res['predicted_by']}`"
            if "predicted_by" in all_res
            else ""
        )
        + ", calibrated at run time like `auto`): median error "
        f"{100 * median(errs):.1f}%, 90th percentile {100 * errs[int(0.9 * (len(errs) - 1))]:.1f}%, worst "
        f"{100 * errs[-1]:.1f}%. `auto`'s pick measured within 5% of the best measured strategy in "
        f"{auto_ok}/{auto_n} cases (cases where the picked variant was among those measured), and within 5% of "
        f"the best of this library's strategies (what `auto` chooses from; PyTorch's private ring is a peer) in "
        f"{auto_ours}/{auto_n}."
        + (
            f" The same model with FIFO sharing between connections (before `Topology.fair_share`): median "
            f"{100 * median(fifo_errs):.1f}%, 90th percentile "
            f"{100 * sorted(fifo_errs)[int(0.9 * (len(fifo_errs) - 1))]:.1f}%, worst {100 * max(fifo_errs):.1f}% "
            f"over {len(fifo_errs)} predictions."
            if fifo_errs
            else ""
        ),
        "",
        "| P | topology | Mbit/s | case | variant | measured ms | predicted ms | error | error with FIFO sharing |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, rate, case, v, meas, pr, e, ef, p in rows:
        L.append(
            f"| {p} | {t} | {rate:g} | {case} | {v} | {ms(meas)} | {ms(pr)} | {100 * e:+.1f}% | "
            + ("-" if ef is None else f"{100 * ef:+.1f}%")
            + " |"
        )
    if sweep:
        L += [
            "",
            "## Rate sweep (mesh, MHA forward, non-causal)",
            "",
            "| Mbit/s | " + " | ".join(n for n in STRATEGIES if n != "auto") + " | ring / token_ring | "
            "ulysses / token_ring | paired (won) |",
            "|" + "---|" * (len(STRATEGIES) + 3),
        ]
        for res in sweep:
            rs = by_name(res)
            cells = [ms(rs[n]["time"]) if n in rs and "time" in rs[n] else "skip" for n in STRATEGIES if n != "auto"]
            L.append(
                f"| {res['testbed']['rate_mbit']:g} | "
                + " | ".join(cells)
                + f" | {rs['ring']['time'] / rs['token_ring']['time']:.2f}x | "
                f"{rs['ulysses']['time'] / rs['token_ring']['time']:.2f}x | "
                f"{paired(res, 'token_ring', 'ulysses')} |"
            )
    if gqa:
        L += [
            "",
            f"## GQA {H}/{GQA_KV} at its own comm-bound rate (mesh, forward)",
            "",
            f"K/V per step is {GQA_KV}/{H} of MHA's, so ring is comm-bound (K/V per step = 2x a block) at "
            f"{gqa[0]['testbed']['rate_mbit']:g} Mbit/s. Ratio = ring / best direct pass-KV variant.",
            "",
            "| case | floor ms | " + " | ".join(GQA_STRATEGIES) + " | best | ring / best direct |",
            "|" + "---|" * (len(GQA_STRATEGIES) + 4),
        ]
        for res in gqa:
            rs = by_name(res)
            fl = floors.get(f"{GQA_KV}-{res['spec']['causal']}-fwd", {}).get("floor")
            timed = {n: r["time"] for n, r in rs.items() if "time" in r}
            best_direct = min(
                t
                for n, t in timed.items()
                if n.startswith("ring:direct") or rs[n].get("variant", "").startswith("ring:direct")
            )
            L.append(
                f"| {shape_label(res['spec'])} | {ms(fl)} | "
                + " | ".join(
                    f"{ms(rs[n]['time'])} [{ms(rs[n]['time_min'])}-{ms(rs[n]['time_max'])}]" if n in timed else "skip"
                    for n in GQA_STRATEGIES
                )
                + f" | {min(timed, key=timed.get)} | {timed['ring'] / best_direct:.2f}x |"
            )
    L += duel_rows(all_res.get("duel")) + what_if_rows(all_res) + notice_rows(gqa) + odd_rows(all_res.get("odd"))
    L += [
        "",
        "Timelines (`tr_<case>_<topology>_timeline.png` beside this file): ring, the paper's TokenRing, the "
        "chosen TokenRing variant and Ulysses on the same time axis; Chrome traces alongside.",
    ]
    L += breakdown_rows(outdir)
    with open(os.path.join(outdir, "token_ring_wins.md"), "w") as f:
        f.write("\n".join(L) + "\n")


# The cases whose traces the breakdown reads (not TRACED, the strategies traced in them)
TRACED_CASES = (("mha_full_fwd", "MHA, non-causal, fwd"), ("mha_causal_both", "MHA, causal, fwd+bwd"))


def trace_breakdown(path: str) -> dict:
    """One traced call's time per rank, from its Chrome trace: compute, exposed waits, the rest (host work
    between them: packing, merging, allocating), and the call's *end tail*: from the last compute to end on any
    rank (TokenRing: the last partials' trip after the slowest partner's last chunk; Ulysses: its last
    all-to-all; pass-KV: none)."""
    with open(path) as f:
        ev = json.load(f)
    ev = [e for e in (ev["traceEvents"] if isinstance(ev, dict) else ev) if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in ev})
    start, end = min(e["ts"] for e in ev), max(e["ts"] + e["dur"] for e in ev)
    comp, wait, last = [], [], []
    for r in ranks:
        mine = [e for e in ev if e["pid"] == r]
        cs = [e for e in mine if e.get("cat") == "compute"]
        comp.append(sum(e["dur"] for e in cs))
        wait.append(sum(e["dur"] for e in mine if e.get("cat") == "exposed wait"))
        last.append(max(e["ts"] + e["dur"] for e in cs))
    n, span = len(ranks), end - start
    return dict(
        call=span / 1e6,
        compute=sum(comp) / n / 1e6,
        compute_max=max(comp) / 1e6,
        wait=sum(wait) / n / 1e6,
        other=(span - (sum(comp) + sum(wait)) / n) / 1e6,
        tail=(end - max(last)) / 1e6,
    )


def breakdown_rows(outdir: str) -> list[str]:
    """Where one traced call's time goes, per strategy (the traces kept beside the report)."""
    rows = []
    for tag, label in TRACED_CASES:
        for name in ("ring", "ulysses", "token_ring_paper", "token_ring"):
            path = os.path.join(outdir, f"tr_{tag}_mesh_{name}.trace.json")
            if os.path.exists(path):
                b = trace_breakdown(path)
                rows.append(
                    f"| {label} | {name} | {ms(b['call'])} | {ms(b['compute'])} | {ms(b['compute_max'])} | "
                    f"{ms(b['wait'])} | {ms(b['other'])} | {ms(b['tail'])} |"
                )
    if not rows:
        return []
    return [
        "",
        "## Where the time goes (mesh, the traced call)",
        "",
        "From the Chrome traces beside this report (one call each, the median call of the run that wrote "
        "them, which may be a later run than the tables': see the header). Per rank, averaged over the "
        "ranks: compute, exposed waits, and the rest of the call (host work between them: packing payloads, "
        "merging partials, allocating, starting the call late). End tail: from the last compute on any rank "
        "to the call's end. Every rank computes while others do, on 2 shared cores, so a rank's compute time "
        "also depends on how many others are computing.",
        "",
        "| case | strategy | call ms | compute ms (mean) | compute ms (max) | exposed wait ms | rest ms | "
        "end tail ms |",
        "|---|---|---|---|---|---|---|---|",
    ] + rows


def odd_section(repeats: int, outdir: str) -> dict:
    """P = 5 (H = 10, 1024 rows per rank): its own calibration and floors; MHA non-causal and causal forward,
    causal forward+backward, on the mesh, the ring of links and the switch."""
    cal = calibrate(repeats, P=ODD_P, H=ODD_H)
    rate = cal["rate_mbit"]
    print(f"[odd P={ODD_P}] block {cal['block_compute_s'] * 1e3:.1f} ms -> {rate} Mbit/s", flush=True)
    grid = [(False, "fwd"), (True, "fwd"), (True, "both")]
    floors = {f"{ODD_H}-{c}-{m}": floor(ODD_H, c, m, repeats, P=ODD_P, H=ODD_H) for c, m in grid}
    cases = []
    for topo in ("mesh", "ring", "switch"):
        for causal, mode in grid:
            print(f"[odd P={ODD_P}] {topo} causal={causal} {mode}", flush=True)
            cases.append(
                run_case(
                    f"odd_{'causal' if causal else 'full'}_{mode}",
                    topo,
                    rate,
                    ODD_H,
                    causal,
                    mode,
                    ODD_STRATEGIES,
                    repeats,
                    outdir,
                    False,
                    P=ODD_P,
                    H=ODD_H,
                )
            )
    return dict(calibration=cal, floors=floors, cases=cases)


def notice_rows(gqa: list[dict]) -> list[str]:
    """The model with and without gloo's ready notices for NOTICE_CASE, against its measurement."""
    for res in gqa:
        nt = res.get("predicted", {}).get("notice")
        if not nt:
            continue
        meas = min(r["time"] for r in res["results"] if r.get("variant") == nt["variant"] and "time" in r)
        return [
            "",
            "## Ready notices in the model",
            "",
            f"gloo's TCP transport sends a message only after the receiver's ready notice, which travels behind "
            f"the data already queued from receiver to sender; the direct schedules therefore post a returning "
            f"partial's receive when its rows leave (`Message.ready`), and the simulator models the notice on the "
            f"testbeds (`Topology.ready_notice`). `{nt['variant']}`, {shape_label(res['spec'])}, mesh at "
            f"{res['testbed']['rate_mbit']:g} Mbit/s: measured {ms(meas)} ms; predicted {ms(nt['model'])} ms "
            f"(the model), {ms(nt['no_notice'])} ms without notices, and {ms(nt['late_receives'])} ms with "
            f"notices but every receive posted with its message (what the executor did before early receives: "
            f"the notice then waits behind the queries the owner sent meanwhile).",
        ]
    return []


def odd_rows(odd: dict | None) -> list[str]:
    """The P = 5 section of the report."""
    if not odd:
        return []
    cal, L = odd["calibration"], []
    sp0 = odd["cases"][0]["spec"]
    L += [
        "",
        f"## Odd P: {sp0['P']} ranks",
        "",
        f"P={sp0['P']}, S={sp0['S']} (1024 rows per rank), H={sp0['H']} (divisible by P, for Ulysses), d={D}, "
        f"float32, B=1; the direct schedules give each rank one bye round per chunk sweep (its own rows). Own "
        f"calibration: one forward block = {ms(cal['block_compute_s'])} ms ({sp0['P']} ranks share the cores), "
        f"comm-bound rate **{cal['rate_mbit']:g} Mbit/s**; floors measured like the P={P} ones.",
        "",
        "| topology | case | floor ms | " + " | ".join(ODD_STRATEGIES) + " | best | token_ring ran | "
        "token_ring vs ring | token_ring vs ulysses | paired (won) | token_ring / floor |",
        "|" + "---|" * (len(ODD_STRATEGIES) + 9),
    ]
    for res in odd["cases"]:
        sp, rs = res["spec"], by_name(res)
        fl = odd["floors"][f"{sp['Hkv']}-{sp['causal']}-{sp['pass']}"]["floor"]
        timed = {n: r["time"] for n, r in rs.items() if "time" in r}
        tr, ring, uly = timed.get("token_ring"), timed.get("ring"), timed.get("ulysses")
        L.append(
            f"| {res['testbed']['topology']} | {shape_label(sp)} | {ms(fl)} | "
            + " | ".join(
                f"{ms(rs[n]['time'])} [{ms(rs[n]['time_min'])}-{ms(rs[n]['time_max'])}]" if n in timed else "skip"
                for n in ODD_STRATEGIES
            )
            + f" | {min(timed, key=timed.get)} | {rs['token_ring'].get('variant', '-')} | {ring / tr:.2f}x | "
            + (f"{uly / tr:.2f}x" if uly else "-")
            + f" | {paired(res, 'token_ring', 'ulysses')} | "
            f"{tr / fl:.2f} |"
        )
    return L


def gqa_section(rate: float, repeats: int, outdir: str) -> list[dict]:
    # exactly Hkv/H of MHA's comm-bound rate (rounding to 10 Mbit/s moved the point: 75 -> 80 is 7% less
    # comm-bound); to 0.5 Mbit/s, which tc takes
    gqa_rate = max(1.0, round(rate * GQA_KV / H * 2) / 2)
    out = []
    for causal in (False, True):
        print(f"[gqa] mesh {gqa_rate:g} Mbit/s causal={causal}", flush=True)
        out.append(
            run_case(
                f"gqa_{'causal' if causal else 'full'}_fwd_cb",
                "mesh",
                gqa_rate,
                GQA_KV,
                causal,
                "fwd",
                GQA_STRATEGIES,
                repeats,
                outdir,
                False,
            )
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--switch-repeats",
        type=int,
        default=11,
        help="repeats of the switch cells (the testbed's widest run-to-run spread)",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gqa-only", action="store_true", help="rerun only the GQA comm-bound part into the result")
    ap.add_argument("--odd-only", action="store_true", help=f"rerun only the P={ODD_P} part into the result")
    ap.add_argument(
        "--floors-only",
        action="store_true",
        help="remeasure only the compute floors and the unshaped runs into the result",
    )
    ap.add_argument(
        "--duel",
        action="store_true",
        help="rerun only the many-rounds comparison of the goal case (token_ring vs ulysses)",
    )
    ap.add_argument("--duel-repeats", type=int, default=25)
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json, measuring nothing")
    ap.add_argument(
        "--repredict",
        action="store_true",
        help="with --report-only: predict the kept measurements again with the model as it is now",
    )
    ap.add_argument(
        "--what-if",
        action="store_true",
        help="with --report-only: add the model's what-if (host work per byte removed) to the kept mesh measurements",
    )
    ap.add_argument(
        "--timelines-only",
        action="store_true",
        help="rerun only the traced cases to redraw their timelines (tables and JSON untouched)",
    )
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc): sudo .venv/bin/python bench/token_ring_wins.py", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    if a.report_only:
        path = os.path.join(a.out, "token_ring_wins.json")
        with open(path) as f:
            all_res = json.load(f)
        if a.repredict:  # measurements kept, the model's predictions redone (and said so in the report)
            for res in all_res["cases"] + all_res["sweep"] + all_res.get("gqa", []) + odd_cases(all_res):
                res["predicted"] = predict(res)
            all_res["date_predicted"] = time.strftime("%Y-%m-%d")
            all_res["predicted_by"] = "sudo .venv/bin/python bench/token_ring_wins.py --report-only --repredict"
        if a.what_if:  # model only: the measurements and their predictions stay as they are
            for res in all_res["cases"] + all_res["sweep"] + odd_cases(all_res):
                if res["testbed"]["topology"] == "mesh" and res["spec"]["Hkv"] == res["spec"]["H"]:
                    res["what_if"] = what_if(res)
            all_res["what_if_date"] = time.strftime("%Y-%m-%d")
            all_res["what_if_by"] = "sudo .venv/bin/python bench/token_ring_wins.py --report-only --what-if"
        if a.repredict or a.what_if:
            with open(path, "w") as f:
                json.dump(all_res, f, indent=1)
        write(all_res, a.out)
        return 0
    if a.timelines_only:
        with open(os.path.join(a.out, "token_ring_wins.json")) as f:
            all_res = json.load(f)
        rate = all_res["calibration"]["rate_mbit"]
        for tag, causal, mode in (("mha_full_fwd", False, "fwd"), ("mha_causal_both", True, "both")):
            run_case(tag, "mesh", rate, H, causal, mode, list(TRACED), a.repeats, a.out, True)
        all_res.setdefault("reruns", []).append(
            dict(
                part="timelines and traces (and so the time breakdown)",
                date=time.strftime("%Y-%m-%d %H:%M"),
                command="sudo .venv/bin/python bench/token_ring_wins.py --timelines-only",
            )
        )
        with open(os.path.join(a.out, "token_ring_wins.json"), "w") as f:
            json.dump(all_res, f, indent=1)
        write(all_res, a.out)
        print(f"redrew the timelines in {a.out} ({time.time() - t0:.0f}s)")
        return 0
    if a.duel:
        path = os.path.join(a.out, "token_ring_wins.json")
        with open(path) as f:
            all_res = json.load(f)
        all_res["duel"] = duel(a.duel_repeats)
        with open(path, "w") as f:
            json.dump(all_res, f, indent=1)
        write(all_res, a.out)
        print(f"wrote {a.out}/token_ring_wins.md ({time.time() - t0:.0f}s)")
        return 0
    if a.gqa_only or a.floors_only or a.odd_only:
        with open(os.path.join(a.out, "token_ring_wins.json")) as f:
            all_res = json.load(f)
        if a.gqa_only:
            all_res["gqa"] = gqa_section(all_res["calibration"]["rate_mbit"], a.repeats, a.out)
        elif a.odd_only:
            all_res["odd"] = odd_section(a.repeats, a.out)
        else:
            keys = {
                key: (int(key.split("-")[0]), key.split("-")[1] == "True", key.split("-")[2])
                for key in all_res["floors"]
            }
            all_res["floors"] = {key: floor(*g, a.repeats) for key, g in keys.items()}
            all_res["unshaped"] = {key: unshaped(*g, a.repeats) for key, g in keys.items()}
        part = "GQA section" if a.gqa_only else f"P={ODD_P} section" if a.odd_only else "floors and unshaped runs"
        flag = "--gqa-only" if a.gqa_only else "--odd-only" if a.odd_only else "--floors-only"
        all_res.setdefault("reruns", []).append(
            dict(
                part=part,
                date=time.strftime("%Y-%m-%d %H:%M"),
                command=f"sudo .venv/bin/python bench/token_ring_wins.py {flag}",
            )
        )
        with open(os.path.join(a.out, "token_ring_wins.json"), "w") as f:
            json.dump(all_res, f, indent=1)
        write(all_res, a.out)
        print(f"wrote {a.out}/token_ring_wins.md ({time.time() - t0:.0f}s)")
        return 0
    cal = calibrate(a.repeats)
    rate = cal["rate_mbit"]
    print(f"[calibration] block {cal['block_compute_s'] * 1e3:.1f} ms -> comm-bound rate {rate} Mbit/s", flush=True)
    topos = ["mesh"] if a.quick else ["mesh", "ring", "switch"]
    grid = [(Hkv, causal, "fwd") for Hkv in (H, 2) for causal in (False, True)]
    if not a.quick:
        grid += [(Hkv, True, "both") for Hkv in (H, 2)]
    floors = {f"{Hkv}-{causal}-{mode}": floor(Hkv, causal, mode, a.repeats) for Hkv, causal, mode in grid}
    free = {f"{Hkv}-{causal}-{mode}": unshaped(Hkv, causal, mode, a.repeats) for Hkv, causal, mode in grid}
    cases = []
    for topo in topos:
        for Hkv, causal, mode in grid:
            tag = f"{'mha' if Hkv == H else 'gqa'}_{'causal' if causal else 'full'}_{mode}"
            traces = topo == "mesh" and (tag in ("mha_full_fwd", "mha_causal_both"))
            print(f"[{time.time() - t0:.0f}s] {topo} {tag}", flush=True)
            cases.append(
                run_case(
                    tag,
                    topo,
                    rate,
                    Hkv,
                    causal,
                    mode,
                    STRATEGIES,
                    a.switch_repeats if topo == "switch" else a.repeats,
                    a.out,
                    traces,
                )
            )
    sweep = []
    if not a.quick:
        for f in (0.5, 1, 2, 4):
            print(f"[{time.time() - t0:.0f}s] sweep {rate * f:g} Mbit/s", flush=True)
            sweep.append(
                run_case(
                    "sweep",
                    "mesh",
                    rate * f,
                    H,
                    False,
                    "fwd",
                    [n for n in STRATEGIES if n != "auto"],
                    max(3, a.repeats - 2),
                    a.out,
                    False,
                )
            )
    all_res = dict(
        calibration=cal,
        floors=floors,
        unshaped=free,
        cases=cases,
        sweep=sweep,
        gqa=[],
        odd=None,
        machine=bench.machine(),
        date=time.strftime("%Y-%m-%d"),
        command="sudo .venv/bin/python bench/token_ring_wins.py",
        repeats=a.repeats,
        switch_repeats=a.switch_repeats,
    )

    def save() -> None:  # after each part, so that a failure later leaves what ran (--gqa-only / --odd-only go on)
        with open(os.path.join(a.out, "token_ring_wins.json"), "w") as f:
            json.dump(all_res, f, indent=1)

    save()
    if not a.quick:
        all_res["gqa"] = gqa_section(rate, a.repeats, a.out)
        save()
        all_res["odd"] = odd_section(a.repeats, a.out)
        save()
        all_res["duel"] = duel(a.duel_repeats)
        save()
    write(all_res, a.out)
    print(f"wrote {a.out}/token_ring_wins.md ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
