#!/usr/bin/env python3
"""The public-API fuzz run of ``tokenring.attention``: random valid and invalid calls at P = 2, 3 and 4 on local gloo
ranks (tests/fuzz_cases.py draws them and states the rules; tests/test_fuzz.py runs a 100-call sample in CI).
Every call's outcome is kept in ``bench/results/fuzz.json``, a summary in ``fuzz.md``:

    .venv/bin/python bench/fuzz.py --calls 700 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import fuzz_cases  # noqa: E402

from tokenring.device import machine  # noqa: E402
from tokenring.tools.launch import RankPool  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=700, help="calls per world size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--chunk", type=int, default=50, help="calls per pool run (a failure names its chunk)")
    a = ap.parse_args(argv)
    res = dict(
        command=f"python bench/fuzz.py --calls {a.calls} --seed {a.seed} --ranks {' '.join(map(str, a.ranks))}",
        machine=machine(),
        rules=fuzz_cases.__doc__,
        runs=[],
    )
    for P in a.ranks:
        calls = fuzz_cases.draw_calls(a.seed, P, a.calls)
        pool = RankPool(P, timeout=60)
        t0 = time.time()
        try:
            for i in range(0, len(calls), a.chunk):
                chunk = calls[i : i + a.chunk]
                try:
                    every = pool.run(fuzz_cases.run_calls, chunk)
                except Exception as e:  # keep going: the failure is the result
                    res["runs"].append(dict(P=P, first=i, failed=str(e)[-4000:]))
                    pool.close()
                    pool = RankPool(P, timeout=60)
                    continue
                for j, per_rank in enumerate(zip(*every)):
                    res["runs"].append(
                        dict(P=P, index=i + j, kind=per_rank[0]["kind"], case=chunk[j],
                             err=max(r.get("err", 0.0) for r in per_rank),
                             messages=[r.get("message") for r in per_rank] if per_rank[0]["kind"] != "valid" else None)
                    )  # fmt: skip
        finally:
            pool.close()
        print(f"P={P}: {len(calls)} calls in {time.time() - t0:.0f} s", flush=True)
    out = os.path.join(HERE, "results", "fuzz")
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(out + ".md", "w") as f:
        f.write(report(res))
    print(report(res))
    return 0


def report(res: dict) -> str:
    runs = [r for r in res["runs"] if "kind" in r]
    failed = [r for r in res["runs"] if "failed" in r]
    valid = [r for r in runs if r["kind"] == "valid"]
    lines = [
        "# Public-API fuzz of tokenring.attention",
        "",
        f"Command: `{res['command']}`. Machine: {res['machine'].get('cpu')}, {res['machine'].get('cores')} cores, "
        f"torch {res['machine'].get('torch')}, local gloo ranks. Rules: tests/fuzz_cases.py.",
        "",
        f"{len(runs)} calls completed ({len(valid)} valid, {len(runs) - len(valid)} invalid); "
        f"{len(failed)} chunks failed" + (":" if failed else "."),
    ]
    for r in failed:
        lines.append(f"- P={r['P']} from call {r['first']}: {r['failed'][-600:]!r}")
    lines += ["", "| P | valid | invalid | worst relative error (float64 / float32 / bfloat16) |", "|---|---|---|---|"]
    for P in sorted({r["P"] for r in runs}):
        mine = [r for r in runs if r["P"] == P]
        worst = {
            dt: max((r["err"] for r in mine if r["kind"] == "valid" and r["case"]["dtype"] == dt), default=None)
            for dt in ("float64", "float32", "bfloat16")
        }
        shown = " / ".join("-" if v is None else f"{v:.2g}" for v in worst.values())
        n_valid = sum(r["kind"] == "valid" for r in mine)
        lines.append(f"| {P} | {n_valid} | {len(mine) - n_valid} | {shown} |")
    kinds = Counter(r["kind"] for r in runs if r["kind"] != "valid")
    strategies = Counter(r["case"]["strategy"] for r in valid)
    features = Counter(
        f for r in valid for f in ("cu_seqlens", "window", "sinks", "dv") if r["case"].get(f) not in (None, False)
    )
    lines += [
        "",
        "Invalid calls (each raised a ValueError on every rank, and the next valid call matched the reference): "
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        "",
        "Valid calls by strategy: " + ", ".join(f"`{k}` {n}" for k, n in sorted(strategies.items())),
        "",
        "Valid calls with documents / windows / sinks / a value head dim of its own: "
        + ", ".join(f"{k} {n}" for k, n in sorted(features.items())),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
