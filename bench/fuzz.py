#!/usr/bin/env python3
"""The public-API fuzz run: random valid and invalid calls at P = 2, 3 and 4 on local gloo ranks, of
``tokenring.attention`` (``--api attention``: tests/fuzz_cases.py draws them and states the rules) or of
tokenring.hf's ``shard_batch`` + HF layers, ``prefill``, ``extend`` and ``generate`` (``--api hf``:
tests/fuzz_hf_cases.py); tests/test_fuzz_sample.py runs a 100-call sample of each in CI. Every call's outcome is
kept in ``bench/results/fuzz[_hf].json``, a summary in ``fuzz[_hf].md``:

    .venv/bin/python bench/fuzz.py --calls 700 --seed 1
    .venv/bin/python bench/fuzz.py --api hf --calls 700 --seed 1
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
import fuzz_hf_cases  # noqa: E402

from tokenring.device import machine  # noqa: E402
from tokenring.tools.launch import RankPool  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=["attention", "hf"], default="attention")
    ap.add_argument("--calls", type=int, default=700, help="calls per world size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--chunk", type=int, default=50, help="calls per pool run (a failure names its chunk)")
    a = ap.parse_args(argv)
    cases = fuzz_cases if a.api == "attention" else fuzz_hf_cases
    res = dict(
        api=a.api,
        command=f"python bench/fuzz.py --api {a.api} --calls {a.calls} --seed {a.seed} "
        f"--ranks {' '.join(map(str, a.ranks))}",
        machine=machine(),
        rules=cases.__doc__,
        runs=[],
    )
    for P in a.ranks:
        calls = cases.draw_calls(a.seed, P, a.calls)
        pool = RankPool(P, timeout=60)
        t0 = time.time()
        try:
            for i in range(0, len(calls), a.chunk):
                chunk = calls[i : i + a.chunk]
                try:
                    every = pool.run(cases.run_calls, chunk)
                except Exception as e:  # keep going: the failure is the result
                    res["runs"].append(dict(P=P, first=i, failed=str(e)[-4000:]))
                    pool.close()
                    pool = RankPool(P, timeout=60)
                    continue
                for j, per_rank in enumerate(zip(*every)):
                    res["runs"].append(
                        dict(P=P, index=i + j, kind=per_rank[0]["kind"], case=chunk[j],
                             err=max(r.get("err", 0.0) for r in per_rank), ok=all(r.get("ok", True) for r in per_rank),
                             failed=[r["failed"] for r in per_rank if r.get("failed")] or None,
                             one_process=[r["one_process"] for r in per_rank if r.get("one_process")] or None,
                             messages=[r.get("message") for r in per_rank] if per_rank[0]["kind"] != "valid" else None)
                    )  # fmt: skip
        finally:
            pool.close()
        print(f"P={P}: {len(calls)} calls in {time.time() - t0:.0f} s", flush=True)
    out = os.path.join(HERE, "results", "fuzz" if a.api == "attention" else "fuzz_hf")
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(out + ".md", "w") as f:
        f.write(report(res))
    print(report(res))
    return 0


NONE = (None, False)


def report(res: dict) -> str:
    hf = res.get("api") == "hf"
    runs = [r for r in res["runs"] if "kind" in r]
    failed = [r for r in res["runs"] if "first" in r]  # chunks that failed whole
    valid = [r for r in runs if r["kind"] == "valid"]
    rules = "tests/fuzz_hf_cases.py" if hf else "tests/fuzz_cases.py"
    api = "tokenring.hf: shard_batch, prefill, extend, generate" if hf else "tokenring.attention"
    lines = [
        f"# Public-API fuzz of {api}",
        "",
        f"Command: `{res['command']}`. Machine: {res['machine'].get('cpu')}, {res['machine'].get('cores')} cores, "
        f"torch {res['machine'].get('torch')}, local gloo ranks. Rules: {rules}.",
        "",
        f"{len(runs)} calls completed ({len(valid)} valid, {len(runs) - len(valid)} invalid); "
        f"{len(failed)} chunks failed" + (":" if failed else "."),
    ]
    for r in failed:
        lines.append(f"- P={r['P']} from call {r['first']}: {r['failed'][-600:]!r}")
    wrong = [r for r in runs if not r.get("ok", True)]  # (attention only: the hf rules compare with one process)
    near = [r for r in runs if r.get("ok", True) and r.get("one_process")]
    if not hf:
        lines += ["", f"Valid calls out of both bounds: {len(wrong)}" + (":" if wrong else ".")]
        lines += [f"- P={r['P']} call {r['index']} {r['case']}: {'; '.join(r['failed'])}" for r in wrong]
        lines += [
            "",
            f"Valid calls over the dtype's tolerance but within the bound of the same call in one process: "
            f"{len(near)}" + (":" if near else "."),
        ]
    for r in near:
        worst = {k: max(o[k] for o in r["one_process"]) for k in r["one_process"][0]}
        shown = ", ".join(f"{k} {v:.3g}" for k, v in worst.items())
        lines.append(f"- P={r['P']} call {r['index']} {r['case']}: largest error {r['err']:.3g}; one process: {shown}")
    dtypes = ("float64",) if hf else ("float64", "float32", "bfloat16")
    lines += ["", f"| P | valid | invalid | worst relative error ({' / '.join(dtypes)}) |", "|---|---|---|---|"]
    for P in sorted({r["P"] for r in runs}):
        mine = [r for r in runs if r["P"] == P]
        worst = {
            dt: max(
                (r["err"] for r in mine if r["kind"] == "valid" and r["case"].get("dtype", "float64") == dt),
                default=None,
            )
            for dt in dtypes
        }
        shown = " / ".join("-" if v is None else f"{v:.2g}" for v in worst.values())
        n_valid = sum(r["kind"] == "valid" for r in mine)
        lines.append(f"| {P} | {n_valid} | {len(mine) - n_valid} | {shown} |")
    kinds = Counter(r["kind"] for r in runs if r["kind"] != "valid")
    lines += [
        "",
        "Invalid calls (each raised a ValueError on every rank, and the next valid call matched the reference): "
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        "",
    ]
    if hf:
        tallies = {
            "Valid calls by kind": Counter(r["case"]["kind"] for r in valid),
            "by model family": Counter(r["case"]["arch"] for r in valid),
            "by strategy": Counter(r["case"]["strategy"] for r in valid),
            "by layout": Counter(r["case"]["layout"] for r in valid),
            "training batches by form": Counter(r["case"]["form"] for r in valid if r["case"]["kind"] == "train"),
            "generations sampled / padded": Counter(
                f"sampled={r['case']['sample']} padded={r['case']['padded']}"
                for r in valid
                if r["case"]["kind"] == "generate"
            ),
            "extend strategies": Counter(str(r["case"]["extend"]) for r in valid if r["case"]["kind"] == "extend"),
        }
    else:
        tallies = {
            "Valid calls by strategy": Counter(r["case"]["strategy"] for r in valid),
            "Valid calls with documents / windows / sinks / a value head dim of its own": Counter(
                f for r in valid for f in ("cu_seqlens", "window", "sinks", "dv") if r["case"].get(f) not in NONE
            ),
        }
    for title, counts in tallies.items():
        lines += [f"{title}: " + ", ".join(f"`{k}` {n}" for k, n in sorted(counts.items())), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
