#!/usr/bin/env python3
"""Where a next-turn prefill's time goes, sharded (pass-Q) against replicated: the expected speed-up.

    .venv/bin/python bench/extend_profile.py [--N 32768] [--T 512] [--rounds 3]

P=4 local ranks (1 thread each) hold the demo model's ``ShardedCache`` of ``N`` random rows (as in
``bench/extend.py``) and run ``tokenring.hf.extend`` of ``T`` new tokens, each method ``--rounds`` times
interleaved, the cache rewound after each turn. The last round of each method runs under ``cProfile`` on every
rank; its seconds are split into the attention kernel (PyTorch's CPU flash op), the model's projections and MLP
(``torch.nn.functional.linear``), waiting for other ranks (``c10d`` waits, when the cores run the others), and the
rest. Attention over the cache is the same work in both paths; the sharded path saves the linear layers of
``(P-1)/P`` of the tokens. If nothing else differed, that saving alone would set the speed-up (the "expected"
figure). Other parts differ too (replicated gathers and merges P partials of all T rows), so on a small cache,
where they weigh more, the measured speed-up can exceed it. The parts are wall seconds of ranks sharing cores.
Writes ``bench/results/extend_profile.{md,json}``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import _results  # noqa: E402

METHODS = ("pass_q", "replicated")
PARTS = {  # part -> what a profiled function's name contains
    "attention kernel": "_scaled_dot_product_flash_attention_for_cpu",
    "projections and MLP": "torch._C._nn.linear",
    "waiting": "_distributed_c10d.wait",
}


def split(profile: cProfile.Profile, total: float) -> dict:
    """Seconds per part of :data:`PARTS` (own time of the matching functions), and the rest."""
    stats = pstats.Stats(profile).stats
    out = dict.fromkeys(PARTS, 0.0)
    for (_, _, name), (_, _, tottime, _, _) in stats.items():
        for part, key in PARTS.items():
            if key in name:
                out[part] += tottime
    out["rest"] = max(0.0, total - sum(out.values()))
    return out


def rank_fn(rank: int, P: int, N: int, T: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    from extend import build, filled_cache, rewind, snapshot

    import tokenring.hf as thf

    torch.set_num_threads(1)
    model = build("demo")
    cache = filled_cache(model, N, rank, P)
    state = snapshot(cache)
    convo = torch.randint(0, model.config.vocab_size, (1, N + T), generator=torch.Generator().manual_seed(T))
    times, parts = {m: [] for m in METHODS}, {}
    for rnd in range(rounds):
        for m in METHODS:
            prof = cProfile.Profile() if rnd == rounds - 1 else None
            dist.barrier()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            thf.extend(model, cache, convo, strategy=m)
            if prof:
                prof.disable()
            dt = time.perf_counter() - t0
            times[m].append(dt)
            if prof:
                parts[m] = split(prof, dt)
            rewind(cache, state)
    return dict(times=times, parts=parts)


def main(argv=None) -> int:
    from tokenring.tools import bench
    from tokenring.tools.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=int, default=32768)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    P = 4
    res = spawn(rank_fn, P, a.N, a.T, a.rounds, threads=1, timeout=3600)
    rows = {}
    for m in METHODS:
        per_round = [max(r["times"][m][i] for r in res) for i in range(a.rounds)]
        mean_parts = {k: sum(r["parts"][m][k] for r in res) / P for k in res[0]["parts"][m]}
        rows[m] = dict(median=median(per_round), runs=per_round, parts_mean_over_ranks=mean_parts)
    rep, sq = rows["replicated"], rows["pass_q"]
    saved = rep["parts_mean_over_ranks"]["projections and MLP"] - sq["parts_mean_over_ranks"]["projections and MLP"]
    busy = {m: sum(v for k, v in rows[m]["parts_mean_over_ranks"].items() if k != "waiting") for m in METHODS}
    expected = busy["replicated"] / max(1e-9, busy["replicated"] - saved)
    m = bench.machine()
    cmd = f".venv/bin/python bench/extend_profile.py --N {a.N} --T {a.T} --rounds {a.rounds}"
    lines = [
        f"# Where a next-turn prefill's time goes: demo model, cache {a.N}, {a.T} new tokens, P={P}",
        "",
        f"Machine: {m['cpu']}, {os.cpu_count()} cores, torch {m['torch']}, gloo on loopback, {P} ranks x 1 thread. "
        f"Command: `{cmd}`. Turn: median of {a.rounds} interleaved rounds (min-max), slowest rank. Parts: the last "
        f"round under cProfile, own seconds of the matching functions, mean over ranks.",
        "",
        "| method | turn (s) | " + " | ".join(f"{p} (s)" for p in [*PARTS, "rest"]) + " |",
        "|---|---|" + "---|" * (len(PARTS) + 1),
    ]
    for meth in METHODS:
        r = rows[meth]
        parts = r["parts_mean_over_ranks"]
        lines.append(
            f"| {meth} | {r['median']:.3f} ({min(r['runs']):.3f}-{max(r['runs']):.3f}) | "
            + " | ".join(f"{parts[p]:.3f}" for p in [*PARTS, "rest"])
            + " |"
        )
    lines += [
        "",
        f"Measured speed-up: x{rep['median'] / sq['median']:.2f}. The sharded path saves {saved:.3f} s of linear "
        f"layers per rank; if nothing else differed, a rank's busy time (all but waiting) would go from "
        f"{busy['replicated']:.3f} s to {busy['replicated'] - saved:.3f} s: an expected x{expected:.2f}.",
    ]
    _results.write(
        os.path.join(HERE, "results", "extend_profile"),
        dict(command=cmd, machine=m, N=a.N, T=a.T, P=P, rows=rows, saved_s=saved, busy_s=busy, expected=expected),
        lines,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
