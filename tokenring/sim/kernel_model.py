"""Kernel-time model: how long one block attention (forward or backward), a merge or a copy takes: a roofline
with a fitted launch cost, from the shipped H200 table, a CPU timing or a fixed CPU model (docs/sim.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from importlib import resources

import numpy as np

from ..kernels import block_backward, block_forward
from ..merge import merge_, new_accumulator
from ..strategies.spec import Spec

__all__ = [
    "KernelModel",
    "DEVICES",
    "kernel_model",
    "h200_table",
    "fit_table",
    "calibrate_cpu",
    "cpu_share",
    "CPU_ANALYTIC",
    "block_flops",
    "block_row",
    "model_to_dict",
    "model_from_dict",
]


def block_flops(nq: int, nk: int, H: int, d: int, causal: bool, backward: bool = False) -> float:
    f = 4.0 * nq * nk * H * d * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


@dataclass(frozen=True)
class KernelModel:
    name: str
    fwd: tuple[float, float]  # (t0 seconds, peak FLOP/s) for full blocks
    fwd_causal: tuple[float, float]  # for causal diagonal blocks (FLOPs already halved)
    bwd: tuple[float, float]
    bwd_causal: tuple[float, float]
    mem_bw: float = 3e12  # bytes/s for the memory-bound terms
    merge: tuple[float, float] = (60e-6, 14e-12)  # (m0 s, s per output element): float32 (o, lse) merge
    add: tuple[float, float] = (10e-6, 3e-12)  # elementwise accumulate, s per element
    source: str = ""
    step: float = 30e-6  # host time per step on each rank that takes part in it
    curves: tuple = ()  # measured points per (backward, causal), log FLOPs -> log seconds
    speed: float = 1.0  # divides interpolated times (a device scaled from another's measurements)
    call_factors: tuple = ()  # ((key, factor), ...): per-schedule corrections from real calls (calibration)

    def call_factor(self, strategy: str, causal: bool) -> float:
        """The measured correction for a call of ``strategy`` (1 where no probe matches; docs/sim.md)."""
        if not self.call_factors:
            return 1.0

        spec = Spec.parse(strategy)
        if spec.inner:
            return 1.0
        factors = dict(self.call_factors)
        same = Spec(spec.family, spec.mode, spec.chunks, 1).text() if spec.mode == "direct" else strategy
        for key in (same, spec.family):
            for k in ([f"causal:{key}"] if causal else []) + [key]:
                if k in factors:
                    return factors[k]
        return 1.0

    def _curve(self, backward: bool, causal: bool, F: float) -> float | None:
        for b, c, lf, lt in self.curves:
            if b == backward and c == causal and lf[0] <= np.log(F) <= lf[-1]:
                return float(np.exp(np.interp(np.log(F), lf, lt))) / self.speed
        return None

    def block_time(
        self, nq: int, nk: int, H: int, Hkv: int, d: int, causal: bool, backward: bool, elem: int = 2
    ) -> float:
        F = block_flops(nq, nk, H, d, causal, backward)
        t0, peak = (self.bwd_causal if causal else self.bwd) if backward else (self.fwd_causal if causal else self.fwd)
        io = (2 * nq * H + 2 * nk * Hkv) * d * elem * (2 if backward else 1)
        measured = self._curve(backward, causal, F) if self.curves else None
        return max(measured if measured is not None else t0 + F / peak, io / self.mem_bw)

    def merge_time(self, elems: float) -> float:
        return self.merge[0] + elems * self.merge[1] if elems else 0.0

    def add_time(self, elems: float) -> float:
        return self.add[0] + elems * self.add[1] if elems else 0.0

    def copy_time(self, nbytes: float) -> float:
        return 2.0 * nbytes / self.mem_bw  # read + write

    def scaled(self, name: str, speed: float, mem_speed: float, source: str) -> "KernelModel":
        """Same efficiency curve, peaks times ``speed`` and memory rates times ``mem_speed``."""
        s = lambda p: (p[0], p[1] * speed)
        m = lambda p: (p[0], p[1] / mem_speed)
        return replace(
            self,
            name=name,
            fwd=s(self.fwd),
            fwd_causal=s(self.fwd_causal),
            bwd=s(self.bwd),
            bwd_causal=s(self.bwd_causal),
            mem_bw=self.mem_bw * mem_speed,
            merge=m(self.merge),
            add=m(self.add),
            source=source,
            speed=self.speed * speed,
            step=self.step,
        )


def model_to_dict(m: KernelModel) -> dict:
    """JSON-ready form of ``m`` (a calibration profile's kernel), read back by :func:`model_from_dict`."""
    d = {f.name: getattr(m, f.name) for f in fields(m)}
    d["curves"] = [[bool(b), bool(c), list(map(float, lf)), list(map(float, lt))] for b, c, lf, lt in m.curves]
    d["call_factors"] = [[k, float(f)] for k, f in m.call_factors]
    return d


def model_from_dict(d: dict) -> KernelModel:
    d = dict(d)
    curves = tuple((bool(b), bool(c), np.array(lf), np.array(lt)) for b, c, lf, lt in d.pop("curves", ()))
    pairs = {k: tuple(map(float, d[k])) for k in ("fwd", "fwd_causal", "bwd", "bwd_causal", "merge", "add") if k in d}
    factors = tuple((str(k), float(f)) for k, f in d.pop("call_factors", ()))
    return KernelModel(**{**d, **pairs}, curves=curves, call_factors=factors)


def _fit_line(F: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Least squares of relative error for ``t = t0 + F / peak`` (t0 >= 0)."""
    A = np.stack([np.ones_like(F), F], axis=1) / t[:, None]
    (t0, inv), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if t0 < 0 or inv <= 0:  # noisy or tiny samples: fall back to pure throughput
        t0, inv = 0.0, float(np.sum(F / t) / np.sum((F / t) ** 2))
    return float(t0), float(1.0 / inv)


@lru_cache(maxsize=None)
def h200_table() -> dict:
    """The shipped H200 measurements (see the file's ``source`` / ``provenance`` fields)."""
    with resources.files("tokenring.data").joinpath("h200_sdpa.json").open() as f:
        return json.load(f)


def fit_table(
    rows: list[dict], backend: str = "flash", name: str = "h200", mem_bw: float | None = None, source: str = ""
) -> KernelModel:
    """Fit a :class:`KernelModel` to rows of measured square blocks (batch 1)."""
    fits, curves = {}, []
    for causal in (False, True):
        sel = [r for r in rows if bool(r["causal"]) == causal]
        F = np.array([block_flops(r["n"], r["n"], r["hq"], r["d"], causal) for r in sel])
        tf = np.array([r[f"{backend}_fwd_ms"] for r in sel]) * 1e-3
        tb = np.array([r[f"{backend}_fb_ms"] - r[f"{backend}_fwd_ms"] for r in sel]) * 1e-3
        fits[("f", causal)] = _fit_line(F, tf)
        fits[("b", causal)] = _fit_line(2.5 * F, tb)
        for backward, FF, tt in ((False, F, tf), (True, 2.5 * F, tb)):
            pts = {}
            for f, t in zip(FF, tt):  # several rows at one size (GQA): average their times
                pts.setdefault(float(f), []).append(float(t))
            xs = sorted(pts)
            curves.append((backward, causal, np.log(np.array(xs)), np.log(np.array([np.mean(pts[x]) for x in xs]))))
    merge = (60e-6, 14e-12)
    mrows = [r for r in rows if "merge_ms" in r]
    if mrows:
        E = np.array([r["n"] * r["hq"] * r["d"] for r in mrows], dtype=float)
        tm = np.array([r["merge_ms"] for r in mrows]) * 1e-3
        A = np.stack([np.ones_like(E), E], axis=1)
        (m0, c), *_ = np.linalg.lstsq(A, tm, rcond=None)
        merge = (max(float(m0), 0.0), float(c))
    mem = mem_bw or 3e12
    return KernelModel(
        name,
        fits[("f", False)],
        fits[("f", True)],
        fits[("b", False)],
        fits[("b", True)],
        mem_bw=mem,
        merge=merge,
        add=(merge[0] / 4, merge[1] / 4),
        source=source,
        curves=tuple(curves),
    )


@lru_cache(maxsize=None)
def _h200(backend: str = "flash") -> KernelModel:
    d = h200_table()
    return fit_table(
        d["rows"],
        backend,
        "h200",
        mem_bw=d.get("d2d_copy_TBps", 4.2) * 1e12,
        source=f"fitted to tokenring/data/h200_sdpa.json (H200, PyTorch {backend} SDPA op, bf16): " + d["provenance"],
    )


# other devices: the H200 curve scaled by peak and efficiency, memory by HBM bandwidth (docs/sim.md)
_H200_PEAK, _H200_MEM = 989e12, 4.8e12
DEVICES = {
    # name: (dense peak FLOP/s, fraction of it attention reaches / fraction the H200 reaches, HBM B/s, note)
    "h200": (989e12, 1.0, 4.8e12, "measured table"),
    "h100": (989e12, 1.0, 3.35e12, "H100 SXM: same tensor cores as H200 (989 TFLOP/s dense bf16), 3.35 TB/s HBM3"),
    "a10": (
        125e12,
        1.7,
        0.6e12,
        "A10: 125 TFLOP/s dense fp16, 600 GB/s; FlashAttention-2 reaches ~60% of peak on "
        "Ampere vs ~35% on Hopper (FA2 paper), hence x1.7 relative efficiency",
    ),
    "ascend910b": (313e12, 1.4, 1.6e12, "Ascend 910B: ~313 TFLOP/s fp16, 1.6 TB/s HBM; ~50% of peak in FA (estimate)"),
    "mi300x": (
        1307e12,
        1.0,
        5.3e12,
        "MI300X: 1307 TFLOP/s dense fp16, 5.3 TB/s; CK FlashAttention ~35% of peak (estimate)",
    ),
    "b200": (2250e12, 1.0, 8e12, "B200: 2250 TFLOP/s dense bf16, 8 TB/s HBM3e; the H200's fraction of peak (estimate)"),
    "a100": (
        312e12,
        1.7,
        2.0e12,
        "A100 SXM: 312 TFLOP/s dense bf16, 2.0 TB/s; FlashAttention-2 reaches ~60% of "
        "peak on Ampere vs ~35% on Hopper (FA2 paper), hence x1.7",
    ),
    "l40s": (362e12, 1.4, 0.864e12, "L40S: 362 TFLOP/s dense bf16, 864 GB/s GDDR6; ~50% of peak in FA2 (estimate)"),
}
# devices whose kernel is cuDNN's (compute capability 9.0 and newer); the others run the flash op
CUDNN_DEVICES = ("h200", "h100", "b200")


# CPU, analytic: a measured x86 core, frozen so that every rank computes the same choice (docs/sim.md;
# the step: bench/results/token_ring_wins.md)
def _cpu_analytic(threads: int = 1, share: float = 1.0) -> KernelModel:
    g = 1e9 * threads * share
    return KernelModel(
        f"cpu-analytic-{threads}t" + (f"-share{share:.2g}" if share < 1 else ""),
        (170e-6, 80 * g),
        (400e-6, 65 * g),
        (220e-6, 80 * g),
        (1000e-6, 63 * g),
        mem_bw=10e9 * share,
        merge=(50e-6, 0.75e-9 / share),
        add=(12e-6, 0.19e-9 / share),
        source="analytic CPU model (a measured x86 core, frozen), not calibrated here",
        step=2e-3 / share,
    )


CPU_ANALYTIC = _cpu_analytic(1)
_CPU_CACHE: dict = {}


# calibration blocks (rows n, heads): small ones for the fixed costs, a long one for the asymptote
CALIB_BLOCKS = ((256, 4), (1024, 4), (4096, 1))


def block_row(n: int, H: int, Hkv: int, d: int, dtype, causal: bool, best, gen, device="cpu", prefix="cpu") -> dict:
    """One measured row for :func:`fit_table`: block forward, backward and merge of an ``n x n`` block, in ms."""
    import torch

    scale = d**-0.5
    q, do = (torch.randn(1, n, H, d, generator=gen, dtype=dtype).to(device) for _ in range(2))
    k, v = (torch.randn(1, n, Hkv, d, generator=gen, dtype=dtype).to(device) for _ in range(2))
    out, lse = block_forward(q, k, v, causal, scale)
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    tf = best(lambda: block_forward(q, k, v, causal, scale))
    tb = best(lambda: block_backward(do, q, k, v, lse, delta, causal, scale, out=out))
    acc_o, acc_l = new_accumulator(1, n, H, d, dtype, device)
    merge_(acc_o, acc_l, out, lse)
    tm = best(lambda: merge_(acc_o, acc_l, out, lse))
    return {
        "hq": H,
        "hkv": Hkv,
        "n": n,
        "d": d,
        "causal": causal,
        f"{prefix}_fwd_ms": tf * 1e3,
        f"{prefix}_fb_ms": (tf + tb) * 1e3,
        "merge_ms": tm * 1e3,
    }


def _calib_rows(threads: int, dtype_name: str, blocks, d: int, repeats: int, barrier=None) -> list[dict]:
    import torch

    dtype = getattr(torch, dtype_name)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)

    def best(fn):
        if barrier is not None:  # every timing process measures the same kernel at once
            barrier.wait()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    try:
        g = torch.Generator().manual_seed(0)
        return [block_row(n, H, H, d, dtype, causal, best, g) for n, H in blocks for causal in (False, True)]
    finally:
        torch.set_num_threads(old)


def _calib_child(args, barrier, queue):
    queue.put(_calib_rows(*args, barrier=barrier))


def calibrate_cpu(
    threads: int | None = None, dtype=None, blocks=CALIB_BLOCKS, d: int = 64, repeats: int = 2, concurrent: int = 1
) -> KernelModel:
    """Time ``tokenring.kernels`` on this CPU and fit a :class:`KernelModel` (once per process per
    ``(threads, dtype, concurrent)``; ``concurrent`` timing processes at once)."""
    import torch

    dtype = dtype or torch.float32
    threads = threads or torch.get_num_threads()
    key = (threads, str(dtype), concurrent, blocks)
    if key in _CPU_CACHE:
        return _CPU_CACHE[key]
    args = (threads, str(dtype).replace("torch.", ""), blocks, d, repeats)
    if concurrent <= 1:
        rows = _calib_rows(*args)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        barrier, queue = ctx.Barrier(concurrent), ctx.Queue()
        procs = [ctx.Process(target=_calib_child, args=(args, barrier, queue)) for _ in range(concurrent)]
        for p in procs:
            p.start()
        runs = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        rows = []
        for i, row in enumerate(runs[0]):
            rows.append(
                dict(
                    row, **{k: sum(r[i][k] for r in runs) / len(runs) for k in ("cpu_fwd_ms", "cpu_fb_ms", "merge_ms")}
                )
            )
    where = f"{threads} thread(s)" + (f", {concurrent} processes at once" if concurrent > 1 else "")
    model = fit_table(
        rows,
        "cpu",
        f"cpu-{threads}t" + (f"-x{concurrent}" if concurrent > 1 else ""),
        mem_bw=5e9,
        source=f"calibrated at run time: tokenring.kernels on this CPU, {where}, {dtype}",
    )
    model = replace(model, add=(model.merge[0] / 4, model.merge[1] / 4))
    _CPU_CACHE[key] = model
    return model


def cpu_share(P: int, threads: int, cores: int | None = None) -> float:
    """Fraction of its threads' cores a rank gets when ``P`` ranks x ``threads`` share ``cores``."""
    import os

    cores = cores or os.cpu_count() or 1
    return min(1.0, cores / max(1, P * threads))


def kernel_model(
    device: str = "h200",
    threads: int = 1,
    calibrated: bool = False,
    dtype=None,
    share: float = 1.0,
    concurrent: int = 1,
    backend: str | None = None,
) -> KernelModel:
    """The model for a device name (a key of :data:`DEVICES`, or ``cpu``: analytic unless ``calibrated``);
    ``backend``: the SDPA op a GPU model is fitted to."""
    if device == "cpu":
        if not calibrated:
            return _cpu_analytic(threads, share)
        m = calibrate_cpu(threads, dtype, concurrent=concurrent)
        return (
            m
            if share >= 1
            else m.scaled(
                m.name + f"-share{share:.2g}", share, share, m.source + f"; x{share:.2g} for ranks sharing cores"
            )
        )
    if device not in DEVICES:
        raise ValueError(f"no kernel model for device {device!r}; choose one of {', '.join(DEVICES)} or cpu")
    backend = backend or ("cudnn" if device in CUDNN_DEVICES else "flash")
    base = _h200(backend)
    if device == "h200":
        return base
    peak, rel, mem, note = DEVICES[device]
    return base.scaled(
        device, peak / _H200_PEAK * rel, mem / _H200_MEM, source=f"{note}; shape of the H200 {backend} fit"
    )
