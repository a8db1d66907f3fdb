#!/usr/bin/env python3
"""Every decoder family of the installed transformers, sharded at P ranks: exact against one process, or refused.

    .venv/bin/python bench/families.py [--ranks 2 3 4] [--tokens-per-rank 12]

Each family is a tiny config (``tests/family_cases.py``: hidden 64, 4 layers, GQA 4/2, float32, random
weights) with ``attn_implementation="tokenring"``: one training step (forward, backward, gradients summed over
the ranks) vs transformers' own attention in one process. A family either matches (logits, loss, every
parameter's gradient: relative errors reported) or is refused with a ValueError on every rank. For every
refused hybrid the same step is also run with the refusal switched off, to show what it prevents: the
error the sharded run would have returned silently. Writes ``bench/results/families.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _results  # noqa: E402
import family_cases  # noqa: E402

from tokenring.tools.launch import RankPool  # noqa: E402


def run(rank: int, P: int, names: list[str], S: int) -> list[dict]:
    from tokenring.mixers import find_mixers

    warnings.filterwarnings("ignore")
    out = []
    for name in names:
        res = family_cases.one_family(rank, P, name, S)
        res["mixers"] = [str(m) for m in find_mixers(family_cases.build(name, family_cases.FAMILIES[name][2]))]
        if res["mixers"]:  # what running them whole prevents: the same step with them on each rank's shard
            off = family_cases.one_family(rank, P, name, S, check=False)
            res["unprepared"] = {k: off.get(k) for k in ("outcome", "logits", "loss", "grad", "error")}
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--tokens-per-rank", type=int, default=12)
    args = ap.parse_args()
    import transformers

    names = list(family_cases.FAMILIES)
    data = {"transformers": transformers.__version__, "ranks": args.ranks, "results": {}}
    pools = []  # kept open until the end, as the tests keep theirs
    for P in args.ranks:
        t0 = time.perf_counter()
        pools.append(RankPool(P))
        per_rank = pools[-1].run(run, names, args.tokens_per_rank * P)
        rows = []
        for i, name in enumerate(names):
            mine = [r[i] for r in per_rank]
            row = dict(mine[0])
            row["every_rank"] = [m["outcome"] for m in mine]
            rows.append(row)
        data["results"][P] = rows
        print(f"P={P}: {time.perf_counter() - t0:.1f} s", flush=True)
    for pool in pools:
        pool.close()

    def cell(row: dict) -> str:
        if row["outcome"] == "refused":
            same = all(o == "refused" for o in row["every_rank"])
            return f"refused{'' if same else ' (NOT on every rank)'}"
        w = row.get("unprepared")
        off = f"; mixers on one shard: logits {w['logits']:.0e}" if w and w.get("logits") is not None else ""
        return f"{row['outcome']} (logits {row['logits']:.0e}, grads {row['grad']:.0e} / floor {row['floor']:.0e}{off})"

    lines = [
        "# Decoder families sharded at P ranks: exact or refused",
        "",
        f"transformers {transformers.__version__}, torch CPU, gloo ranks on one host. Command: "
        f"`.venv/bin/python bench/families.py --ranks {' '.join(map(str, args.ranks))}`. Tiny configs from "
        "`tests/family_cases.py` (hidden 64, 4 layers, 4/2 heads, float64 weights, the loss taken in float64 "
        f"from the logits), {args.tokens_per_rank} tokens per rank, one training step vs transformers' own "
        "attention in one process. Errors are relative to the largest reference value (max over logits / every "
        "parameter's gradient). Exact: logits and loss < 1e-9 (1e-6 against transformers' eager attention, "
        "whose softmax is float32) and every gradient < 1e-9 or within 4x the floor: how far the one process's "
        "own gradient moves when its loss is summed per rank's rows (float32 inside some kernels: norms, "
        "routers, the GDN and Mamba scans). Hybrids' sequence mixers run on the whole sequence on every rank "
        "(tokenring.mixers); 'mixers on one shard' is the same step with them left on each rank's shard, what "
        "a user got before.",
        "",
        "| family | model | " + " | ".join(f"P={P}" for P in args.ranks) + " | refusal (P=2) |",
        "|---|---|" + "---|" * len(args.ranks) + "---|",
    ]
    for i, name in enumerate(names):
        first = data["results"][args.ranks[0]][i]
        why = first.get("error", "")
        why = why[why.find(": ") + 2 :][:160] + ("..." if len(why) > 160 else "") if why else ""
        cells = " | ".join(cell(data["results"][P][i]) for P in args.ranks)
        lines.append(f"| {name} | {first['model']} | {cells} | {why.replace('|', '/')} |")
    outcomes = [r["outcome"] for P in args.ranks for r in data["results"][P]]
    lines += [
        "",
        f"{len(names)} families x {len(args.ranks)} world sizes: {outcomes.count('exact')} exact, "
        f"{outcomes.count('refused')} refused, {outcomes.count('differs')} differ silently.",
    ]
    _results.write(os.path.join(HERE, "results", "families"), data, lines)


if __name__ == "__main__":
    main()
