#!/usr/bin/env python3
"""Packed sequences and sliding windows: time and bytes per call vs the unpacked sequence, per strategy, next to
the simulator's prediction; and the causal load balance of the layouts over packed documents.

    .venv/bin/python bench/packed.py [--seq 8192] [--ranks 4] [--repeats 3]

For each mask (none; 16 documents of S/16 tokens; 16 random-length documents; a 512-token window) and causal /
non-causal: P local gloo ranks on this machine (1 torch thread each), B=1, H=8, Hkv=2, d=64, float32,
forward+backward per call, strategies token_ring (the cost model's variant), token_ring:relay, ring and
ulysses. Per call: the slowest rank's wall time (after a barrier), and the bytes every rank sent (comm log).
Every output and gradient of the first call is checked against a float32 single-process SDPA with the same
mask written out in full. Predicted: ``tokenring.sim.simulate`` on the topology and kernel model ``auto`` uses
here (loopback, the analytic CPU model). Load balance: per rank, the query-key pairs its tiles compute
(forward), max / mean over ranks, zigzag vs contiguous vs zigzag_docs (every document zigzagged over the
ranks; all strategies compute the same pairs per rank in total). Causal packed runs use all three layouts. Writes
every timed call to ``bench/results/packed.json`` and the table to ``packed.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402
import torch  # noqa: E402

STRATEGIES = ["token_ring", "token_ring:relay", "ring", "ulysses"]
_REFS: dict = {}


def masks(S: int, P: int) -> dict:
    """The masks compared; the random documents' lengths are multiples of 2P so that the per-document layout
    (``zigzag_docs``) applies to them too."""
    rng = random.Random(0)
    unit = 2 * P
    return {
        "none": {},
        "16 equal docs": dict(cu_seqlens=list(range(0, S + 1, S // 16))),
        "16 random docs": dict(cu_seqlens=[0] + sorted(unit * x for x in rng.sample(range(1, S // unit), 15)) + [S]),
        "window 512": dict(window=(512, 512)),
    }


def _reference(full, causal, kw, S):
    """float32 SDPA over the whole sequence with the mask written out (independent of tokenring.masks)."""
    import torch.nn.functional as F

    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = torch.ones(S, S, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if "cu_seqlens" in kw:
        doc = torch.bucketize(torch.arange(S), torch.tensor(kw["cu_seqlens"][1:-1]), right=True)
        ok &= doc[:, None] == doc[None, :]
    if "window" in kw:
        left, right = kw["window"]
        ok &= (j >= i - left) & (j <= i + (0 if causal else right))
    q, k, v, do = (t.transpose(1, 2).clone().requires_grad_(n < 3) for n, t in enumerate(full))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=True)
    out.backward(do)
    return [out.transpose(1, 2)] + [t.grad.transpose(1, 2) for t in (q, k, v)]


def rank_fn(rank: int, P: int, S: int, causal: bool, layout: str, name: str, kw: dict, repeats: int) -> dict:
    import torch.distributed as dist

    import tokenring
    from tokenring.layouts import local_positions

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, S, h, 64, generator=g) for h in (8, 2, 2, 8)]
    idx = local_positions(S, P, rank, layout, cu_seqlens=kw.get("cu_seqlens"))
    local = [t.index_select(1, idx) for t in full]
    times, sent, err = [], [], None
    for i in range(repeats + 1):
        q, k, v = (t.clone().requires_grad_() for t in local[:3])
        log: list = []
        dist.barrier()
        t0 = time.perf_counter()
        with tokenring.instrument(comm_log=log):
            out = tokenring.attention(q, k, v, causal=causal, layout=layout, strategy=name, **kw)
        out.backward(local[3])
        t1 = time.perf_counter()
        slow = torch.tensor([t1 - t0])
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        if i == 0:  # warm-up call: checked, not timed
            key = (S, P, causal, layout, repr(kw))
            if key not in _REFS:  # one reference per mask, shared by the strategies (each rank checks its rows)
                _REFS.clear()
                _REFS[key] = [r.index_select(1, idx) for r in _reference(full, causal, kw, S)]
            ref = _REFS[key]
            err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip([out, q.grad, k.grad, v.grad], ref))
            continue
        times.append(slow.item())
        sent.append(sum(r["bytes"] for _, recs in log for r in recs if r["direction"] == "send"))
    from tokenring.api import resolve

    ran = resolve(
        name,
        local[0].shape,
        local[1].shape,
        P,
        dtype=torch.float32,
        causal=causal,
        layout=layout,
        backward=True,
        mask=_mask(S, kw, causal, layout),
    ).name
    return dict(times=times, bytes_sent=sent[0], max_rel_err=err, ran=ran)


def _mask(S, kw, causal, layout="zigzag"):
    from tokenring.masks import make_mask

    return make_mask(S, kw.get("cu_seqlens"), kw.get("window"), causal, force=layout == "zigzag_docs")


def predicted(name: str, S: int, P: int, causal: bool, layout: str, kw: dict) -> float:
    from tokenring.schedules import Shapes
    from tokenring.sim.auto import _kernel, get_current_topology
    from tokenring.sim.simulator import simulate

    topo, _ = get_current_topology(P, "cpu")
    sh = Shapes(1, S // P, 8, 2, 64, torch.float32, P)
    return simulate(
        name, sh, topo, _kernel(topo, P), causal=causal, layout=layout, backward=True, mask=_mask(S, kw, causal, layout)
    ).time


def balance(S: int, P: int, kw: dict, layout: str) -> float:
    """max / mean over ranks of the query-key pairs a rank's forward computes (ring's schedule; every strategy
    computes the same pairs per rank in total), counted from the tiles (a masked tile: its visible pairs)."""
    from tokenring.masks import shard_rows, shard_tiles
    from tokenring.schedules import part_slice
    from tokenring.strategies import get

    mask = _mask(S, kw, True, layout)
    s = S // P
    work = [0] * P
    for st in get("ring").schedule(P, layout, True, False, mask).steps:
        for c in st.computes:
            qs, ks = part_slice(c.q_part, s), part_slice(c.kv_part, s)
            qpos = shard_rows(mask, P, layout, c.q_owner, qs)
            kpos = shard_rows(mask, P, layout, c.kv_owner, ks)
            for t in shard_tiles(mask, P, layout, c.q_owner, (qs.start, qs.stop), c.kv_owner, (ks.start, ks.stop)):
                n, m = t.q1 - t.q0, t.k1 - t.k0
                work[c.rank] += (
                    n * m
                    if t.kind == "full"
                    else n * (n + 1) // 2
                    if t.kind == "causal"
                    else int(t.mask(mask, qpos, kpos).sum())
                )
    return max(work) / (sum(work) / P)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "packed"))
    a = ap.parse_args(argv)
    from tokenring.tools import bench
    from tokenring.tools.launch import RankPool

    S, P = a.seq, a.ranks
    rows = []
    pool = RankPool(P, threads=1, timeout=3600)
    try:
        for causal in (False, True):
            for mname, kw in masks(S, P).items():
                layouts = (
                    ["zigzag", "contiguous", "zigzag_docs"]
                    if causal and "docs" in mname
                    else ["zigzag" if causal else "contiguous"]
                )
                for layout in layouts:
                    for name in STRATEGIES:
                        r = pool.run(rank_fn, S, causal, layout, name, kw, a.repeats)[0]
                        row = dict(
                            causal=causal,
                            mask=mname,
                            layout=layout,
                            strategy=name,
                            **r,
                            time=median(r["times"]),
                            predicted=predicted(r["ran"], S, P, causal, layout, kw),
                        )
                        rows.append(row)
                        print(
                            f"causal={causal} {mname:15s} {layout:10s} {name:17s} -> {r['ran']:26s} "
                            f"{row['time']:.3f} s (min {min(r['times']):.3f}, max {max(r['times']):.3f}), "
                            f"{r['bytes_sent'] / 1e6:.2f} MB sent, predicted {row['predicted']:.3f} s, "
                            f"err {r['max_rel_err']:.2g}",
                            flush=True,
                        )
    finally:
        pool.close()
    bal = [
        dict(mask=m, layout=lay, max_over_mean=balance(S, P, kw, lay))
        for m, kw in masks(S, P).items()
        if kw
        for lay in ("zigzag", "contiguous", "zigzag_docs")
        if "cu_seqlens" in kw or lay != "zigzag_docs"
    ]
    base = {
        (r["causal"], r["layout"] if r["mask"] != "none" else r["layout"], r["strategy"]): r
        for r in rows
        if r["mask"] == "none"
    }
    out = [
        f"# Packed sequences and sliding windows vs unpacked, P={P}, S={S}",
        "",
        f"Machine: {bench.machine()['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}, gloo on loopback, "
        f"{P} ranks x 1 thread. B=1 H=8 Hkv=2 d=64 float32, forward+backward per call; median of {a.repeats} "
        f"calls after a checked warm-up (min-max in brackets). Command: `.venv/bin/python bench/packed.py "
        f"--seq {S} --ranks {P} --repeats {a.repeats}`. Ratios are vs the same strategy unpacked (for a "
        f"contiguous causal layout: vs unpacked zigzag). Predicted: the simulator on the loopback topology.",
        "",
        "| causal | mask | layout | strategy (ran) | time s | vs unpacked | predicted vs unpacked | MB sent "
        "(all ranks) | bytes vs unpacked | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["causal"], "zigzag" if r["causal"] else "contiguous", r["strategy"]))
        out.append(
            f"| {r['causal']} | {r['mask']} | {r['layout']} | {r['strategy']} ({r['ran']}) | "
            f"{r['time']:.3f} [{min(r['times']):.3f}-{max(r['times']):.3f}] | {r['time'] / b['time']:.2f} | "
            f"{r['predicted'] / b['predicted']:.2f} | {r['bytes_sent'] / 1e6:.2f} | "
            f"{r['bytes_sent'] / max(1, b['bytes_sent']):.2f} | {r['max_rel_err']:.1e} |"
        )
    out += [
        "",
        "Causal load balance (forward query-key pairs per rank, max / mean; 1.00 = perfect):",
        "",
        "| mask | zigzag | contiguous | zigzag_docs (each document zigzagged) |",
        "|---|---|---|---|",
    ]
    for m in masks(S, P):
        got = {b["layout"]: b["max_over_mean"] for b in bal if b["mask"] == m}
        if got:
            per_doc = got.get("zigzag_docs")
            out.append(
                f"| {m} | {got['zigzag']:.2f} | {got['contiguous']:.2f} | "
                f"{'-' if per_doc is None else f'{per_doc:.2f}'} |"
            )
    _results.write(
        a.out,
        dict(
            machine=bench.machine(),
            S=S,
            P=P,
            shapes=dict(B=1, H=8, Hkv=2, d=64, dtype="float32"),
            rows=rows,
            balance=bal,
        ),
        out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
