#!/usr/bin/env python3
"""Time ``import tokenring`` (after ``import torch``) at this checkout and at an older commit, interleaved, in fresh
interpreters; writes every run to ``bench/results/import_time.json``:

    .venv/bin/python bench/import_time.py [--base ad951c9] [--runs 12]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROBE = (
    "import json, sys, time; import torch; t = time.perf_counter(); import tokenring; "
    "print(json.dumps([(time.perf_counter() - t) * 1e3, "
    "sorted(m for m in sys.modules if m.startswith('tokenring.sim'))]))"
)


def once(src: str) -> tuple[float, list]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=src),
    ).stdout
    t, mods = json.loads(out)
    return t, mods


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="ad951c9")
    ap.add_argument("--runs", type=int, default=12)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as old:
        subprocess.run(f"git -C {ROOT} archive {a.base} tokenring | tar -x -C {old}", shell=True, check=True)
        runs = {"before": [], "after": []}
        sim = {}
        for _ in range(a.runs):
            for label, src in (("before", old), ("after", ROOT)):
                t, mods = once(src)
                runs[label].append(t)
                sim[label] = mods
    res = dict(
        command="python bench/import_time.py",
        base=a.base,
        machine=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        runs_ms=runs,
        median_ms={k: median(v) for k, v in runs.items()},
        sim_modules_loaded=sim,
    )
    with open(os.path.join(HERE, "results", "import_time.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(
        f"import tokenring after torch: before ({a.base}) {res['median_ms']['before']:.1f} ms, "
        f"after {res['median_ms']['after']:.1f} ms (medians of {a.runs}); simulator modules loaded: "
        f"before {len(sim['before'])}, after {len(sim['after'])}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
