#!/usr/bin/env python3
"""Planning time per call at large P: the first call builds the schedule and this rank's plan, later calls look
them up.

    .venv/bin/python bench/plan_time.py [--ranks 64 256 1024] [--lookups 2000]
    .venv/bin/python bench/plan_time.py --docs 16 --ranks 4 16 64 256 [--masks 5]   # a new mask per call

What a call plans: the strategy from its spec (``tokenring.strategies.get``), the schedule
(``Strategy.rank_schedule``: the whole schedule, cached per P/layout/causal/pass; with a mask only this rank's
part of it) and this rank's per-step plan with its read index (``tokenring.executor._rank_plan``, cached per
schedule and rank). For each P, strategy and mask, forward and backward: the first (building) call once, and
the median of ``--lookups`` later calls. With ``--docs N``: what packed training pays when every step brings
new documents: ``--masks`` fresh masks of ``N`` random documents (causal, zigzag, local lengths ``--local``),
each planned from scratch (nothing cached for it), timed one by one, this rank's part and (up to
``--whole-up-to`` ranks) the whole schedule as calls built it before, interleaved per mask. Writes
``bench/results/plan_time.json`` (``plan_time_docs.json`` with ``--docs``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tokenring.executor import _rank_plan  # noqa: E402
from tokenring.masks import make_mask  # noqa: E402
from tokenring.strategies import get  # noqa: E402


def plan(spec: str, P: int, layout: str, causal: bool, backward: bool, rank: int, mask=None, whole=False):
    """What a call plans (``Strategy.rank_schedule``: with a mask, this rank's part alone); ``whole``: the whole
    schedule instead, as calls did before (the simulator still does)."""
    st = get(spec)
    if whole:
        sched = st.schedule(P, layout, causal, backward, mask)
    else:
        sched = st.rank_schedule(P, layout, causal, backward, mask, rank)
    return _rank_plan(sched, rank, True)


def masked(a) -> list[dict]:
    """Planning a call whose documents are new (packed training): one fresh mask at a time, this rank's part
    (what a call builds) and the whole schedule (what calls built before), interleaved per mask."""
    import random

    rows = []
    for s in a.local:
        for P in a.ranks:
            S = s * P
            for spec in a.strategies:
                for backward in (False, True):
                    laps: dict[str, list[float]] = {"rank": [], "whole": []}
                    for i in range(a.masks):
                        cuts = sorted(random.Random(1000 * P + i).sample(range(1, S), a.docs - 1))
                        mask = make_mask(S, [0] + cuts + [S], None, True)
                        for how in ("rank", "whole") if P <= a.whole_up_to else ("rank",):
                            t0 = time.perf_counter()
                            plan(spec, P, "zigzag", True, backward, P // 3, mask, whole=how == "whole")
                            laps[how].append(time.perf_counter() - t0)
                    row = dict(P=P, strategy=spec, backward=backward, docs=a.docs, local_length=s)
                    for how, xs in laps.items():
                        if xs:
                            row[f"{how}_per_new_mask_ms"] = [x * 1e3 for x in xs]
                            row[f"{how}_median_ms"] = median(xs) * 1e3
                    rows.append(row)
                    whole = f", whole schedule {row['whole_median_ms']:9.1f} ms" if laps["whole"] else ""
                    print(
                        f"s={s:5d} P={P:5d} {spec:26s} {'bwd' if backward else 'fwd'}: a new mask of {a.docs} "
                        f"documents plans in {row['rank_median_ms']:7.2f} ms (range {min(laps['rank']) * 1e3:.2f}-"
                        f"{max(laps['rank']) * 1e3:.2f}, {a.masks} masks){whole}",
                        flush=True,
                    )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--strategies", nargs="+", default=["token_ring:relay", "ring", "ring_bidir", "ulysses"])
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=0, help="plan fresh masks of this many documents instead")
    ap.add_argument("--masks", type=int, default=5)
    ap.add_argument("--local", type=int, nargs="+", default=[64, 4096], help="local lengths, with --docs")
    ap.add_argument("--whole-up-to", type=int, default=256, help="also time whole schedules up to this P")
    a = ap.parse_args(argv)
    from tokenring.tools.bench import machine as machine_of

    machine = machine_of()
    if a.docs:
        out = dict(
            command="python bench/plan_time.py " + " ".join(argv or sys.argv[1:]), machine=machine, rows=masked(a)
        )
        with open(os.path.join(HERE, "results", "plan_time_docs.json"), "w") as f:
            json.dump(out, f, indent=1)
        return 0
    rows = []
    for P in a.ranks:
        for spec in a.strategies:
            for causal, layout in ((False, "contiguous"), (True, "zigzag")):
                for backward in (False, True):
                    rank = P // 3  # any rank: a middle one
                    t0 = time.perf_counter()
                    plan(spec, P, layout, causal, backward, rank)
                    first = time.perf_counter() - t0
                    laps = []
                    for _ in range(a.lookups):
                        t0 = time.perf_counter()
                        plan(spec, P, layout, causal, backward, rank)
                        laps.append(time.perf_counter() - t0)
                    rows.append(
                        dict(
                            P=P,
                            strategy=spec,
                            causal=causal,
                            backward=backward,
                            first_s=first,
                            cached_median_us=median(laps) * 1e6,
                            cached_max_us=max(laps) * 1e6,
                        )
                    )
                    r = rows[-1]
                    print(
                        f"P={P:5d} {spec:18s} causal={causal!s:5s} {'bwd' if backward else 'fwd'}: first call "
                        f"{first:8.3f} s, later calls median {r['cached_median_us']:.2f} us "
                        f"(max {r['cached_max_us']:.1f} us)",
                        flush=True,
                    )
    out = dict(command="python bench/plan_time.py " + " ".join(argv or sys.argv[1:]), machine=machine, rows=rows)
    with open(os.path.join(HERE, "results", "plan_time.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
