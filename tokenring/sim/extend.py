"""The simulator for inference over a sharded cache: the very schedules :mod:`tokenring.extend` and
:mod:`tokenring.decode` run (:mod:`tokenring.strategies.extend`), costed step by step as the simulator costs the
symmetric ones (docs/sim.md, "Extend's simulator").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..strategies.extend import STRATEGIES, Shards, extend_bytes, schedule
from .auto import _kernel, get_current_topology
from .kernel_model import KernelModel
from .topology import Topology

__all__ = ["ExtendResult", "simulate_extend", "choose", "candidates"]


@dataclass
class ExtendResult:
    strategy: str
    time: float  # seconds per call (the slowest rank)
    compute: float  # seconds of compute on that rank
    bytes_in: int  # bytes rank 0 receives (payloads)

    def to_dict(self) -> dict:
        return dict(strategy=self.strategy, time=self.time, compute=self.compute, bytes_in=self.bytes_in)


def candidates(P: int, H: int, Hkv: int) -> list[str]:
    """The schedules that can run these heads on ``P`` ranks."""
    return [s for s in STRATEGIES if s != "ulysses" or (H % P == 0 and Hkv % P == 0)]


def _rows_time(km: KernelModel, B, tq, qa, n, ka, kb, H, Hkv, d, elem) -> float:
    """Time of :func:`tokenring.extend.attend_rows` without a mask: the cached block, the causal square, the rest."""
    old, qb = n - (kb - ka), qa + tq
    pieces = []
    if old:
        pieces.append((tq, old, False))
    lo, hi = max(qa, ka), min(qb, kb)
    if lo < hi:
        if lo > ka:
            pieces.append((hi - lo, lo - ka, False))
        pieces.append((hi - lo, hi - lo, True))
    if kb > ka and qb > max(qa, kb):
        pieces.append((qb - max(qa, kb), kb - ka, False))
    return sum(
        km.block_time(B * nq, nk, H, Hkv, d, causal, False, elem) + km.merge_time(B * nq * H * d)
        for nq, nk, causal in pieces
    )


def _message_bytes(strategy: str, sh: Shards, B, H, Hkv, d, elem):
    """``bytes(m)`` of an extend message, sized by the shards as :class:`tokenring.extend.RowsOps` sizes it."""
    acc, P = 8 if elem == 8 else 4, sh.P
    h, hk = H // P, Hkv // P

    def size(m) -> int:
        j = m.owner
        if m.kind == "out":  # replicated: every query's partial; else the partial of the receiver's queries
            return B * (sh.T if strategy == "replicated" else sh.t(m.dst)) * H * (d + 1) * acc
        return {
            "q": lambda: B * sh.t(j) * H * d * elem,
            "kv": lambda: 2 * B * sh.rows[j] * Hkv * d * elem,
            "pos": lambda: 8 * sh.cached(j),
            "u_qkv": lambda: B * (sh.t(j) * h + 2 * sh.rows[j] * hk) * d * elem,
            "u_out": lambda: B * sh.t(m.dst) * h * d * elem,
        }[m.kind]()

    return size


def _compute_time(strategy: str, sh: Shards, r: int, cs: list, B, H, Hkv, d, elem, km) -> float:
    """Seconds of rank ``r``'s computes of one step, batched as :class:`tokenring.extend.RowsOps` batches them."""
    if strategy in ("ulysses", "replicated"):  # every rank's queries (of one head group) against rows of kv_owner
        h, hk = (H // sh.P, Hkv // sh.P) if strategy == "ulysses" else (H, Hkv)
        return sum(_rows_time(km, B, sh.T, 0, sh.rows[c.kv_owner], *sh.new[c.kv_owner], h, hk, d, elem) for c in cs)
    if len(cs) > 1 and all(c.kv_owner == r for c in cs):  # the cached block once for the batch, then new rows
        rows, cached = sum(sh.t(c.q_owner) for c in cs), sh.cached(r)
        t = 0.0
        if rows and cached:
            t = km.block_time(B * rows, cached, H, Hkv, d, False, False, elem) + km.merge_time(B * rows * H * d)
        new = sh.rows[r] - cached
        return t + sum(
            _rows_time(km, B, sh.t(c.q_owner), sh.new[c.q_owner][0], new, *sh.new[r], H, Hkv, d, elem) for c in cs
        )
    return sum(
        _rows_time(km, B, sh.t(c.q_owner), sh.new[c.q_owner][0], sh.rows[c.kv_owner], *sh.new[c.kv_owner], H, Hkv,
                   d, elem)
        for c in cs
    )  # fmt: skip


def simulate_extend(
    strategy: str, sh: Shards, B: int, H: int, Hkv: int, d: int, elem: int, topo: Topology, km: KernelModel
) -> ExtendResult:
    """Seconds per call of ``strategy`` on ``topo`` with kernels ``km``: the schedule the executor runs
    (:func:`tokenring.strategies.extend.schedule`), step by step (docs/sim.md)."""
    P = sh.P
    if strategy == "ulysses" and (H % P or Hkv % P):
        raise ValueError(f"ulysses needs query heads ({H}) and key/value heads ({Hkv}) divisible by P={P}")
    topo = topo.with_P(P) if topo.P != P else topo
    size = _message_bytes(strategy, sh, B, H, Hkv, d, elem)
    T, busy = np.zeros(P), np.zeros(P)
    starts, due = [], {}  # each step's start per rank; due step -> [(src, dst, finish)]
    for t, step in enumerate(schedule(strategy, sh).steps):
        starts.append(T.copy())
        comp = np.full(P, km.step)
        for r in range(P):
            mine = [c for c in step.computes if c.rank == r]
            comp[r] += _compute_time(strategy, sh, r, mine, B, H, Hkv, d, elem, km) if mine else 0.0
        if step.messages:
            src, dst = (np.array([getattr(m, x) for m in step.messages]) for x in ("src", "dst"))
            nb = np.array([size(m) for m in step.messages], dtype=float)
            posted = np.array([starts[m.ready if m.ready >= 0 else t][m.dst] for m in step.messages])
            fin = np.maximum(T[src], posted) + topo.flow_times(src, dst, nb)
            if topo.cpu_per_byte:
                comp += topo.cpu_per_byte * (
                    np.bincount(src, weights=nb, minlength=P) + np.bincount(dst, weights=nb, minlength=P)
                )
            for m, f in zip(step.messages, fin):
                due.setdefault(m.due if m.due >= 0 else t, []).append((m.src, m.dst, f))
        end = T + comp
        for s_, d_, f in due.pop(t, ()):
            end[s_], end[d_] = max(end[s_], f), max(end[d_], f)
        busy += comp
        T = end
    last = int(np.argmax(T))
    if strategy in STRATEGIES:
        moved = extend_bytes(strategy, sh, B, H, Hkv, d, elem)
    else:  # replicated
        moved = (P - 1) * B * sh.T * H * (d + 1) * (8 if elem == 8 else 4)
    return ExtendResult(strategy, float(T[last]), float(busy[last]), moved)


def choose(shards: Shards, B: int, H: int, Hkv: int, d: int, dtype: torch.dtype, device_type: str = "cpu") -> str:
    """The schedule :func:`simulate_extend` predicts fastest for these shards on the current topology."""
    topo, _ = get_current_topology(shards.P, device_type)
    km = _kernel(topo, shards.P)
    elem = torch.empty((), dtype=dtype).element_size()
    results = [simulate_extend(s, shards, B, H, Hkv, d, elem, topo, km) for s in candidates(shards.P, H, Hkv)]
    return min(results, key=lambda r: r.time).strategy
