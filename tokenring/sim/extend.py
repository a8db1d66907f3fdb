"""The simulator for :mod:`tokenring.extend`: its schedules as steps, costed as the simulator costs the symmetric
ones (docs/sim.md, "Extend's simulator").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..strategies.extend import STRATEGIES, Shards, batches, extend_bytes
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


def _steps(strategy: str, sh: Shards, B, H, Hkv, d, elem, km):
    """``[(compute seconds per rank, [(src, dst, bytes), ...]), ...]`` for one call."""
    P = sh.P
    acc = 8 if elem == 8 else 4
    qbytes = [B * sh.t(j) * H * d * elem for j in range(P)]
    obytes = [B * sh.t(j) * H * (d + 1) * acc for j in range(P)]

    def att(qj, kj):  # rank qj's queries against rank kj's rows
        a, b = sh.new[qj]
        return _rows_time(km, B, b - a, a, sh.rows[kj], *sh.new[kj], H, Hkv, d, elem) if b > a else 0.0

    steps = []
    if strategy == "pass_q":  # groups of at least BATCH_ROWS query rows, own rows first (extend._batches)
        groups = [batches([(r + i) % P for i in range(P)], sh) for r in range(P)]

        def group_time(r: int, g: list[int]) -> float:
            rows, cached = sum(sh.t(j) for j in g), sh.cached(r)
            t = km.block_time(B * rows, cached, H, Hkv, d, False, False, elem) if rows and cached else 0.0
            new = sh.rows[r] - cached  # then each rank's queries against my new rows
            return t + sum(_rows_time(km, B, sh.t(j), sh.new[j][0], new, *sh.new[r], H, Hkv, d, elem) for j in g)

        last = max(len(g) for g in groups)
        for x in range(last + 1):
            comp = [group_time(r, groups[r][x]) if x < len(groups[r]) else 0.0 for r in range(P)]
            msgs = [(r, j, qbytes[r]) for r in range(P) for j in range(P) if j != r] if x == 0 else []
            if x:  # the previous group's partials go home
                msgs += [
                    (r, j, obytes[j]) for r in range(P) if x - 1 < len(groups[r]) for j in groups[r][x - 1] if j != r
                ]
            steps.append((comp, msgs))
    elif strategy == "pass_q_relay":
        for i in range(P):
            comp = [att((r + i) % P, r) for r in range(P)]
            hop = [((r + 1) % P, r, qbytes[(r + i + 1) % P]) for r in range(P)] if i + 1 < P else []
            back = [(r, (r + i - 1) % P, obytes[(r + i - 1) % P]) for r in range(P)] if i > 1 else []
            steps.append((comp, hop + back))
        steps.append(([0.0] * P, [(r, (r + P - 1) % P, obytes[(r + P - 1) % P]) for r in range(P)]))
    elif strategy == "pass_kv":
        for i in range(P):
            comp = [att(r, (r - i) % P) for r in range(P)]
            hop = (
                [(r, (r + 1) % P, 2 * B * sh.rows[(r - i) % P] * Hkv * d * elem) for r in range(P)] if i + 1 < P else []
            )
            steps.append((comp, hop))
    elif strategy == "ulysses":
        h, hk = H // P, Hkv // P
        a2a = [(r, j, B * (sh.t(r) * h + 2 * sh.rows[r] * hk) * d * elem) for r in range(P) for j in range(P) if j != r]
        steps.append(([0.0] * P, a2a))
        comp = sum(_rows_time(km, B, sh.T, 0, sh.rows[j], *sh.new[j], h, hk, d, elem) for j in range(P))
        steps.append(([comp] * P, []))
        steps.append(([0.0] * P, [(r, j, B * sh.t(j) * h * d * elem) for r in range(P) for j in range(P) if j != r]))
    elif strategy == "replicated":
        comp = [_rows_time(km, B, sh.T, 0, sh.rows[r], *sh.new[r], H, Hkv, d, elem) for r in range(P)]
        steps.append((comp, [(r, j, B * sh.T * H * (d + 1) * acc) for r in range(P) for j in range(P) if j != r]))
    else:
        raise ValueError(f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return steps


def simulate_extend(
    strategy: str, sh: Shards, B: int, H: int, Hkv: int, d: int, elem: int, topo: Topology, km: KernelModel
) -> ExtendResult:
    """Seconds per call of ``strategy`` on ``topo`` with kernels ``km`` (docs/sim.md)."""
    P = sh.P
    if strategy == "ulysses" and (H % P or Hkv % P):
        raise ValueError(f"ulysses needs query heads ({H}) and key/value heads ({Hkv}) divisible by P={P}")
    topo = topo.with_P(P) if topo.P != P else topo
    T = np.zeros(P)
    busy = np.zeros(P)
    for comp, msgs in _steps(strategy, sh, B, H, Hkv, d, elem, km):
        comp = np.asarray(comp, dtype=float) + km.step
        end = T + comp
        if msgs:
            src, dst, nb = (np.array(x) for x in zip(*msgs))
            fin = np.maximum(T[src], T[dst]) + topo.flow_times(src, dst, nb)
            if topo.cpu_per_byte:
                moved = np.bincount(src, weights=nb, minlength=P) + np.bincount(dst, weights=nb, minlength=P)
                comp = comp + topo.cpu_per_byte * moved
                end = T + comp
            np.maximum.at(end, src, fin)
            np.maximum.at(end, dst, fin)
        busy += comp
        T = end
    last = int(np.argmax(T))
    moved = 0
    if strategy in STRATEGIES:
        moved = extend_bytes(strategy, sh, B, H, Hkv, d, elem)
    elif strategy == "replicated":
        moved = (P - 1) * B * sh.T * H * (d + 1) * (8 if elem == 8 else 4)
    return ExtendResult(strategy, float(T[last]), float(busy[last]), moved)


def choose(shards: Shards, B: int, H: int, Hkv: int, d: int, dtype: torch.dtype, device_type: str = "cpu") -> str:
    """The schedule :func:`simulate_extend` predicts fastest for these shards on the current topology."""
    topo, _ = get_current_topology(shards.P, device_type)
    km = _kernel(topo, shards.P)
    elem = torch.empty((), dtype=dtype).element_size()
    results = [simulate_extend(s, shards, B, H, Hkv, d, elem, topo, km) for s in candidates(shards.P, H, Hkv)]
    return min(results, key=lambda r: r.time).strategy
