#!/usr/bin/env python3
"""Seconds per test file from pytest logs (the "seconds per file" table tests/conftest.py prints at the end of
every run), summed over the logs given (the quick and the slow tier of one CI run), beside an earlier run.

    bash .ci/run 2>&1 | tee ci.log
    .venv/bin/python bench/test_times.py ci.log [--before bench/results/test_times_before.json] [--label ...]

Writes ``bench/results/test_times.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _results  # noqa: E402

ROW = re.compile(r"^\s*([0-9.]+)\s+(tests/\S+\.py)\s*$")
WALL = re.compile(r"in ([0-9.]+)s")  # pytest's last line: "... passed ... in 612.34s (0:10:12)"


def parse(path: str) -> tuple[dict[str, float], float]:
    files: dict[str, float] = {}
    wall = 0.0
    inside = False
    with open(path) as f:
        for line in f:
            if "seconds per file" in line:
                inside = True
                continue
            m = ROW.match(line)
            if inside and m:
                files[m.group(2)] = files.get(m.group(2), 0.0) + float(m.group(1))
            elif inside and not line.strip().startswith(tuple("0123456789")):
                inside = False
            w = WALL.search(line) if " passed" in line or " failed" in line else None
            if w:
                wall += float(w.group(1))
    return files, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--before", default=os.path.join(HERE, "results", "test_times_before.json"))
    ap.add_argument("--label", default="this run")
    ap.add_argument("--ci-wall", type=float, help="seconds the whole `bash .ci/run` took (venv and installs too)")
    args = ap.parse_args()
    after: dict[str, float] = {}
    walls = []
    for log in args.logs:
        files, wall = parse(log)
        walls.append(wall)
        for k, v in files.items():
            after[k] = after.get(k, 0.0) + v
    with open(args.before) as f:
        before = json.load(f)
    old = before["per_file_s"]
    names = sorted(set(old) | set(after), key=lambda n: -max(old.get(n, 0.0), after.get(n, 0.0)))
    lines = [
        "# Test time per file",
        "",
        f"Command: `.venv/bin/python bench/test_times.py {' '.join(args.logs)}`, the logs of the pytest runs of one "
        "`bash .ci/run` (quick tier, then slow tier) on the 2-core VM. Before: commit "
        f"{before['commit']} ({before['wall_s'] / 60:.1f} min wall for the whole suite, `python -m pytest "
        "--durations=0`, summed per file). Seconds per file, setup + call + teardown.",
        "",
        f"Wall time of the pytest runs ({args.label}): "
        + " + ".join(f"{w / 60:.1f}" for w in walls)
        + f" = {sum(walls) / 60:.1f} min."
        + (
            f" The whole `bash .ci/run` (a fresh venv, installs, lint, both tiers): {args.ci_wall / 60:.1f} min."
            if args.ci_wall
            else ""
        ),
        "",
        "| file | before | after | change |",
        "|---|---|---|---|",
    ]
    for n in names:
        a, b = old.get(n), after.get(n)
        change = f"{b - a:+.1f}" if a is not None and b is not None else "new" if a is None else "gone"
        lines.append(f"| {n} | {'' if a is None else f'{a:.1f}'} | {'' if b is None else f'{b:.1f}'} | {change} |")
    lines.append(f"| all files | {sum(old.values()):.1f} | {sum(after.values()):.1f} | "
                 f"{sum(after.values()) - sum(old.values()):+.1f} |")  # fmt: skip
    data = dict(before=before, after=after, walls=walls, ci_wall_s=args.ci_wall, logs=args.logs, label=args.label)
    _results.write(os.path.join(HERE, "results", "test_times"), data, lines)


if __name__ == "__main__":
    main()
