"""Timelines of a distributed attention call: Chrome-trace JSON (opens in Perfetto / chrome://tracing) and a
PNG with one group of lanes per rank, the picture the TokenRing paper draws with nsys.

Input: the events of :class:`tokenring.comm.Trace` from every rank (dicts with ``lane`` ``"compute"``,
``"send"`` or ``"recv"``, ``start``/``end`` in ``time.perf_counter`` seconds, ``step``, and for messages
``peer``, ``kind``, ``bytes``). ``perf_counter`` is CLOCK_MONOTONIC on Linux, shared by every process of the
machine (network namespaces included), so the ranks' events line up on one time axis.

Traffic is split into two directions **by message kind**, which is what the paper's two streams are; each
kind's flow and colour come from the table :data:`tokenring.messages.KINDS`:

- ``data`` ("forward direction"): inputs travelling to be computed on: ``q``, ``kv``, ``qgrad`` (Q, dO, lse,
  delta) and Ulysses' ``u_qkv`` / ``u_dout``;
- ``results`` ("backward direction"): results travelling home: partial outputs ``out``, ``dq``, the travelling
  dK/dV accumulators ``dkv`` and Ulysses' ``u_out`` / ``u_grad``.

For token_ring these are also two different links (Q goes to ``r - 1``, partials straight to their owner);
for ring both go to ``r + 1``. A message's bar runs from when it was posted to when the rank's ``wait()`` for
that step returned (gloo reports completion only there), so a bar that outlasts the step's compute is
*exposed* communication; the PNG marks it in red on the compute lane.
"""

from __future__ import annotations

import json
from collections import defaultdict

from ..messages import FLOWS
from ..messages import kind as _kind

__all__ = ["direction", "step_metrics", "chrome_trace", "write_chrome_trace", "plot_timeline"]

_TIDS = {"compute": 0, "send data": 1, "send results": 2, "recv data": 3, "recv results": 4, "exposed wait": 5}


def direction(kind: str) -> str:
    """``"data"`` (inputs going out: Q, K/V, Q-grad) or ``"results"`` (partials / gradients going home): the
    kind's flow in :data:`tokenring.messages.KINDS` (``ValueError`` for an unknown kind)."""
    return _kind(kind).flow


def _phase(e: dict) -> str:
    return e.get("phase", "fwd")


def step_metrics(events: list[dict]) -> list[dict]:
    """Per (phase, step) of one rank: ``start``, ``end``, ``time`` (this step's share of the call: from the end
    of the previous step to the end of this one), ``compute`` (sum of its block computes), ``comm`` (longest
    message, post to completion) and ``exposed`` (how long the rank waited for messages after its computes
    were done). Events of one rank only. A message counts at the step it is due (when the rank waits for it),
    which is later than the step that posted it for prefetches and returning partials of direct schedules."""
    by = defaultdict(list)
    for e in events:
        by[(_phase(e), e["step"] if e["lane"] == "compute" else e.get("due", e["step"]))].append(e)
    out, prev_end = [], {}
    order = {"fwd": 0, "bwd": 1}
    for phase, step in sorted(by, key=lambda k: (order.get(k[0], 2), k[1])):
        evs = by[(phase, step)]
        start = min(e["start"] for e in evs)
        end = max(e["end"] for e in evs)
        comp = [e for e in evs if e["lane"] == "compute"]
        msgs = [e for e in evs if e["lane"] != "compute"]
        compute = sum(e["end"] - e["start"] for e in comp)
        comp_end = max((e["end"] for e in comp), default=start)
        msg_end = max((e["end"] for e in msgs), default=comp_end)
        begin = prev_end.get(phase, start)
        out.append(
            dict(
                phase=phase,
                step=step,
                start=start,
                end=end,
                time=end - begin,
                compute=compute,
                comm=max((e["end"] - e["start"] for e in msgs), default=0.0),
                exposed=max(0.0, msg_end - comp_end),
                bytes_data=sum(e["bytes"] for e in msgs if e["lane"] == "send" and direction(e["kind"]) == "data"),
                bytes_results=sum(
                    e["bytes"] for e in msgs if e["lane"] == "send" and direction(e["kind"]) == "results"
                ),
            )
        )
        prev_end[phase] = end
    return out


def _lane(e: dict) -> str:
    if e["lane"] == "compute":
        return "compute"
    return f"{e['lane']} {direction(e['kind'])}"


def chrome_trace(events_by_rank: list[list[dict]], title: str = "") -> dict:
    """Chrome trace-event JSON object: one process (track) per rank, threads compute / send data / send
    results / recv data / recv results / exposed wait; times in microseconds from the earliest event."""
    all_ev = [e for evs in events_by_rank for e in evs]
    t0 = min((e["start"] for e in all_ev), default=0.0)
    out = []
    for r, evs in enumerate(events_by_rank):
        out.append(dict(ph="M", name="process_name", pid=r, tid=0, args=dict(name=f"rank {r}")))
        out.append(dict(ph="M", name="process_sort_index", pid=r, tid=0, args=dict(sort_index=r)))
        for lane, tid in _TIDS.items():
            out.append(dict(ph="M", name="thread_name", pid=r, tid=tid, args=dict(name=lane)))
        for e in evs:
            args = {k: v for k, v in e.items() if k not in ("start", "end", "lane", "name", "rank")}
            name = (
                e["name"]
                if e["lane"] == "compute"
                else f"{e['kind']} {'->' if e['lane'] == 'send' else '<-'} r{e['peer']} ({e['bytes'] / 1e6:.2f} MB)"
            )
            out.append(
                dict(
                    ph="X",
                    name=f"{_phase(e)} s{e['step']}: {name}",
                    cat=_lane(e),
                    pid=r,
                    tid=_TIDS[_lane(e)],
                    ts=(e["start"] - t0) * 1e6,
                    dur=max(0.0, e["end"] - e["start"]) * 1e6,
                    args=args,
                )
            )
        for m in step_metrics(evs):
            if m["exposed"] > 0:
                out.append(
                    dict(
                        ph="X",
                        name=f"{m['phase']} s{m['step']}: exposed wait",
                        cat="exposed wait",
                        pid=r,
                        tid=_TIDS["exposed wait"],
                        ts=(m["end"] - m["exposed"] - t0) * 1e6,
                        dur=m["exposed"] * 1e6,
                        args=dict(step=m["step"], phase=m["phase"]),
                    )
                )
    return dict(traceEvents=out, displayTimeUnit="ms", otherData=dict(title=title))


def write_chrome_trace(path: str, events_by_rank: list[list[dict]], title: str = "") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events_by_rank, title), f)


def plot_timeline(path: str, traces: dict[str, list[list[dict]]], title: str = "") -> None:
    """PNG timeline; ``traces`` maps a label (e.g. a strategy) to its per-rank events. One panel per label,
    sharing the time axis; per rank three lanes: compute (grey, exposed waits red), data sent (blue: Q / K/V)
    and results sent (orange: partials, dQ, dK/dV)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(traces)
    P = max(len(v) for v in traces.values())
    span = 0.0
    starts = {}
    for lab, evr in traces.items():
        all_ev = [e for evs in evr for e in evs]
        t0 = min(e["start"] for e in all_ev)
        starts[lab] = t0
        span = max(span, max(e["end"] for e in all_ev) - t0)
    fig, axes = plt.subplots(len(labels), 1, figsize=(12, 0.9 + 1.05 * P * len(labels)), sharex=True, squeeze=False)
    for ax, lab in zip(axes[:, 0], labels):
        t0 = starts[lab]
        yt, yl = [], []
        for r, evs in enumerate(traces[lab]):
            base = (P - 1 - r) * 3.6
            rows = {"compute": base + 2.4, "data": base + 1.2, "results": base}
            for e in evs:
                x, w = (e["start"] - t0) * 1e3, max(e["end"] - e["start"], 0) * 1e3
                if e["lane"] == "compute":
                    ax.broken_barh(
                        [(x, w)], (rows["compute"], 1.0), facecolors="#7f7f7f", edgecolor="white", linewidth=0.5
                    )
                elif e["lane"] == "send":
                    ax.broken_barh(
                        [(x, w)],
                        (rows[direction(e["kind"])], 1.0),
                        facecolors=_kind(e["kind"]).colour,
                        edgecolor="white",
                        linewidth=0.5,
                        alpha=0.85,
                    )
                    if w > span * 1e3 * 0.04:
                        ax.text(
                            x + w / 2,
                            rows[direction(e["kind"])] + 0.5,
                            f"{e['kind']}->{e['peer']}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white",
                        )
            for m in step_metrics(evs):
                if m["exposed"] > 0:
                    ax.broken_barh(
                        [((m["end"] - m["exposed"] - t0) * 1e3, m["exposed"] * 1e3)],
                        (rows["compute"], 1.0),
                        facecolors="#d62728",
                        alpha=0.8,
                    )
            for name, y in rows.items():
                yt.append(y + 0.5)
                yl.append(f"r{r} {name}")
        ax.set_yticks(yt)
        ax.set_yticklabels(yl, fontsize=7)
        ax.set_title(lab, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time (ms)")
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(color="#7f7f7f", label="compute"),
            Patch(color="#d62728", label="exposed wait"),
            Patch(color=FLOWS["data"], label="data sent (Q, K/V)"),
            Patch(color=FLOWS["results"], label="results sent (partials, dQ, dK/dV)"),
        ],
        loc="lower center",
        fontsize=7,
        ncol=4,
    )
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
