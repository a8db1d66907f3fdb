"""One-shot GPU check: correctness of every strategy on one GPU, kernel throughput, merge cost, a timeline.

    python bench/gpu_check.py                      # on a CUDA machine (one GPU is enough): < 8 min on an H200
    python bench/gpu_check.py --device cpu --quick # tiny shapes on CPU: exercises every part (what the test runs)

It FAILS LOUDLY: every check that failed is listed at the end, and the exit code says what went wrong:
0 all passed, 1 a correctness / functional check failed (or a part crashed or ran out of time), 2 only
performance goals were missed. Results go to ``--out-dir`` (default ``bench/results/gpu/``): ``results.json``
(everything, with the machine), ``results.md`` (the tables), ``timeline.png`` and ``timeline.trace.json``.

1. Correctness. Every strategy (the families of ``tokenring.strategies.STRATEGIES`` plus ``token_ring:relay``
   and ``token_ring:direct,c=2,k=1``; the hierarchical ones over nodes of two ranks), forward and backward, on P=2
   and P=4 local ranks that share GPU 0 (gloo:
   ``tokenring.comm`` stages CUDA tensors through host memory), bf16 / fp16 / fp32, MHA (H=8, Hkv=8) and GQA
   (H=8, Hkv=2), head dims 64, 72, 128, causal (zigzag layout) and not (contiguous): the full cross product at
   S=2048 tokens in all. Reference: PyTorch SDPA (math backend, ``enable_gqa=True``) in float64 on the full
   sequence, forward and backward by autograd, from the very (rounded) inputs the ranks see. Error: max abs
   difference relative to the max abs reference value; tolerances fp32 1e-4 (TF32 off), bf16 3e-2, fp16 5e-3.
   The backward kernel each dtype used (``kernels.pick(..., backward=True)``: fused or math) is recorded.
2. Local block kernels: ``block_forward`` / ``block_backward`` (fused, ``out=`` given) against the fastest
   PyTorch SDPA backend that runs (flash, efficient, cuDNN) at 4K, 8K, 16K tokens, bf16, H=32, d=128, causal
   and not; TFLOP/s (forward 4*n*m*H*d flops, half for causal; backward 2.5x) and the ratio. Goal >= 95%.
   Also a correctness check: our block output and gradients agree with SDPA's.
3. Merge cost: ``merge_`` of an 8K-token block (bf16 in, float32 accumulator, H=32, d=128) against one
   ``block_forward`` at 8K. Goal <= 5%. Also a correctness check: merging two key halves equals one block.
4. Timeline: ``token_ring:direct,c=2,k=1`` at P=2 on the GPU, traced (CUDA events), drawn with
   ``tokenring.tools.trace.plot_timeline``; how much of the message time overlapped compute.

GPU times are CUDA-event medians, CPU times ``time.perf_counter`` medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import tokenring
from tokenring.kernels import pick
from tokenring.strategies import HIERARCHICAL, STRATEGIES

STRATEGY_SPECS = [f for f in STRATEGIES if f not in HIERARCHICAL] + ["token_ring:relay", "token_ring:direct,c=2,k=1"]


def hierarchical_specs(P: int) -> list[str]:
    """The hierarchical strategies on ``P`` ranks: nodes of two ranks where ``P`` is even (all-to-alls, inner
    and outer rings all run), else of one."""
    n = 2 if P % 2 == 0 else 1
    return [f"{f}:n={n}" for f in HIERARCHICAL]


TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
DTYPES = ("bfloat16", "float16", "float32")
HEADS = ((8, 8), (8, 2))  # (H, Hkv): MHA, GQA
HEAD_DIMS = (64, 72, 128)
KERNEL_GOAL = 0.95  # our TFLOP/s >= 95% of the best SDPA backend's
MERGE_GOAL = 0.05  # one merge <= 5% of one block forward
TIMELINE_STRATEGY = "token_ring:direct,c=2,k=1"


def settings(device: str, quick: bool) -> dict:
    """Shapes and sizes of every part, by device and mode."""
    if not quick:
        return dict(
            Ps=(2, 4),
            S=2048,
            seq_kernels=(4096, 8192, 16384),
            H_kernels=32,
            d_kernels=128,
            n_merge=8192,
            timeline=dict(S=16384, H=32, Hkv=32, d=128, dtype="bfloat16"),
            warmup=3,
            repeats=10,
            timeout=120.0,
            reserve_s=60.0,
        )
    base = dict(
        seq_kernels=(128, 256),
        H_kernels=4,
        d_kernels=64,
        n_merge=256,
        timeline=dict(S=256, H=4, Hkv=4, d=32, dtype="float32"),
        warmup=1,
        repeats=3,
        timeout=60.0,
        reserve_s=0.0,
    )
    return dict(base, Ps=(2,) if device == "cpu" else (2, 4), S=64 if device == "cpu" else 256)


def case_name(c: dict) -> str:
    kind = "MHA" if c["H"] == c["Hkv"] else "GQA"
    mask = "causal/zigzag" if c["causal"] else "full/contiguous"
    return f"P={c['P']} {c['strategy']} {c['dtype']} {kind}(H={c['H']},Hkv={c['Hkv']}) d={c['d']} {mask} S={c['S']}"


def correctness_cases(P: int, S: int, quick: bool) -> list[dict]:
    """The full cross product, or (quick) one case per strategy and mask with dtype / heads / head dim cycling so
    that every value appears."""
    cases = []
    specs = STRATEGY_SPECS + hierarchical_specs(P)
    if quick:
        for i, strat in enumerate(specs):
            for c, causal in enumerate((False, True)):
                j = 2 * i + c
                H, Hkv = HEADS[j % 2]
                cases.append(
                    dict(strategy=strat, dtype=DTYPES[j % 3], H=H, Hkv=Hkv, d=HEAD_DIMS[(j // 2) % 3], causal=causal)
                )
    else:
        for dtype in DTYPES:
            for H, Hkv in HEADS:
                for d in HEAD_DIMS:
                    for causal in (False, True):
                        for strat in specs:
                            cases.append(dict(strategy=strat, dtype=dtype, H=H, Hkv=Hkv, d=d, causal=causal))
    for n, c in enumerate(cases):
        c.update(P=P, S=S, layout="zigzag" if c["causal"] else "contiguous", seed=1000 * P + n)
        c["name"] = case_name(c)
    return cases


# ---------------------------------------------------------------- helpers shared by the ranks and the driver


def _setup(device_type: str, timeout: float | None = None) -> torch.device:
    if timeout:
        tokenring.set_timeout(timeout)
    if device_type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, ``perf_counter`` on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _randn(shape, dtype, dev, gen) -> torch.Tensor:
    return torch.randn(*shape, device=dev, generator=gen, dtype=torch.float64).to(dtype)


def _rel(got: torch.Tensor, ref: torch.Tensor, ref_max: float) -> float:
    return (got.double() - ref.double()).abs().max().item() / max(ref_max, 1e-30)


def _sdpa_ref(q, k, v, dout, causal: bool, scale: float):
    """float64 SDPA (math backend) on the full sequence: out, dq, dk, dv in (B, S, heads, d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(
            qr.transpose(1, 2),
            kr.transpose(1, 2),
            vr.transpose(1, 2),
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)
        out.backward(dout.double())
    return out.detach(), qr.grad, kr.grad, vr.grad


# ---------------------------------------------------------------- part 1: correctness (runs on every rank)


def _check_one(rank: int, P: int, dev: torch.device, ref_dev: torch.device, case: dict, inject: bool) -> dict:
    dtype = getattr(torch, case["dtype"])
    S, H, Hkv, d, causal, layout = case["S"], case["H"], case["Hkv"], case["d"], case["causal"], case["layout"]
    scale = d**-0.5
    gen = torch.Generator(device=ref_dev).manual_seed(case["seed"])  # identical full inputs on every rank
    full = [_randn((1, S, h, d), dtype, ref_dev, gen) for h in (H, Hkv, Hkv)]
    dout = _randn((1, S, H, d), dtype, ref_dev, gen)
    ref = _sdpa_ref(*full, dout, causal, scale)
    ref_max = [r.abs().max().item() for r in ref]
    local = [tokenring.shard(t, dim=1, layout=layout).to(dev).detach().clone().requires_grad_() for t in full]
    log: list = []
    with tokenring.instrument(comm_log=log):
        out = tokenring.attention(*local, causal=causal, strategy=case["strategy"], layout=layout)
    out.backward(tokenring.shard(dout, dim=1, layout=layout).to(dev))
    got = [out.detach(), local[0].grad, local[1].grad, local[2].grad]
    if inject:  # test hook: a wrong output must make the script fail and name this case
        got[0] = got[0] + (0.5 * ref_max[0])
    errs, problems = {}, []
    for name, g, r, rmax, like in zip(("out", "dq", "dk", "dv"), got, ref, ref_max, (0, 0, 1, 1)):
        if g is None or g.dtype != dtype or g.shape != local[like].shape:
            problems.append(
                f"{name} has dtype/shape {getattr(g, 'dtype', None)} "
                f"{None if g is None else tuple(g.shape)}, expected {dtype} {tuple(local[like].shape)}"
            )
            errs[name] = float("nan")
            continue
        errs[name] = _rel(g.to(ref_dev), tokenring.shard(r, dim=1, layout=layout), rmax)
    return dict(
        errors=errs,
        problems=problems,
        ran=log[0][0].rsplit(" ", 1)[0] if log else case["strategy"],
        backward_kernel=pick(local[0], "auto", backward=True).name,
    )


def correctness_batch(
    rank: int, P: int, device_type: str, ref_device_type: str, cases: list[dict], inject: str | None, timeout: float
) -> list[dict]:
    """Run ``cases`` on this rank; one result per case run. After an exception the ranks may be out of step
    (one waits in a collective the other left), so the batch stops there: the caller reports the rest and
    starts fresh ranks."""
    dev = _setup(device_type, timeout)
    ref_dev = _setup(ref_device_type) if ref_device_type != device_type else dev
    results = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            r = _check_one(rank, P, dev, ref_dev, case, inject == case["name"] and rank == 0)
        except Exception as e:  # noqa: BLE001 - every failure is reported by the driver
            results.append(
                dict(
                    name=case["name"],
                    rank=rank,
                    error=f"{type(e).__name__}: {e}",
                    traceback=traceback.format_exc(limit=6),
                    seconds=time.perf_counter() - t0,
                )
            )
            break
        results.append(dict(name=case["name"], rank=rank, seconds=time.perf_counter() - t0, **r))
    _sync(dev)
    return results


# ---------------------------------------------------------------- part 4: timeline (runs on every rank)


def timeline_rank(rank: int, P: int, device_type: str, shape: dict, strategy: str, timeout: float) -> dict:
    import torch.distributed as dist

    from tokenring.comm import Trace

    dev = _setup(device_type, timeout)
    dtype = getattr(torch, shape["dtype"])
    S, H, Hkv, d = shape["S"], shape["H"], shape["Hkv"], shape["d"]
    gen = torch.Generator(device=dev).manual_seed(7)
    full = [_randn((1, S, h, d), dtype, dev, gen) for h in (H, Hkv, Hkv, H)]
    local = [tokenring.shard(t, dim=1, layout="zigzag") for t in full]

    def call(trace=None):
        q, k, v = (t.detach().clone().requires_grad_() for t in local[:3])
        with tokenring.instrument(trace=trace):
            out = tokenring.attention(q, k, v, causal=True, strategy=strategy, layout="zigzag")
        n_fwd = len(trace.events) if trace is not None else 0
        out.backward(local[3])
        return n_fwd

    call()  # warm-up: kernels, signature check, schedules
    _sync(dev)
    dist.barrier()
    trace = Trace(rank)
    t0 = time.perf_counter()
    n_fwd = call(trace)
    _sync(dev)
    wall = time.perf_counter() - t0
    trace.resolve()
    events = []
    for i, e in enumerate(trace.events):
        e = {key: (float(val) if key in ("start", "end") else val) for key, val in e.items()}
        e["phase"] = "fwd" if i < n_fwd else "bwd"
        events.append(e)
    return dict(events=events, wall_s=wall, cuda_events=trace.cuda)


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersection(x, y) -> float:
    """Total length of the intersection of two unions of intervals (each sorted and disjoint)."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        tot += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def overlap_stats(events: list[dict]) -> dict:
    """One rank's events of one phase: compute and message time (unions) and how much of the messages'
    time overlapped compute."""
    comp = _union([(e["start"], e["end"]) for e in events if e["lane"] == "compute"])
    msgs = _union([(e["start"], e["end"]) for e in events if e["lane"] != "compute"])
    ov = _intersection(comp, msgs)
    span = (max(e["end"] for e in events) - min(e["start"] for e in events)) if events else 0.0
    return dict(
        compute_ms=_length(comp) * 1e3,
        message_ms=_length(msgs) * 1e3,
        overlap_ms=ov * 1e3,
        overlap_frac=ov / _length(msgs) if msgs and _length(msgs) > 0 else 0.0,
        span_ms=span * 1e3,
        n_compute=sum(e["lane"] == "compute" for e in events),
        n_messages=sum(e["lane"] != "compute" for e in events),
    )


# ---------------------------------------------------------------- the driver


class Report:
    """Collects results, failures (correctness / functional) and missed goals (performance)."""

    def __init__(self, args, sets: dict):
        self.data: dict = dict(
            args=vars(args),
            settings={k: v for k, v in sets.items()},
            started=datetime.datetime.now().isoformat(timespec="seconds"),
        )
        self.failures: list[str] = []
        self.goals_missed: list[str] = []
        self.md: list[str] = []
        self.deferred: list = []  # tables printed after the others (the timeline runs with the P=2 ranks)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"FAIL: {what}", flush=True)

    def miss(self, what: str) -> None:
        self.goals_missed.append(what)


def table(report: Report, title: str, headers: list[str], rows: list[list]) -> None:
    """Print a table (rich when importable) and add it to the markdown report."""
    cells = [[str(c) for c in r] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title, title_justify="left")
        for h in headers:
            t.add_column(h)
        for r in cells:
            t.add_row(*r)
        Console(width=200).print(t)
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()
    report.md += [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    report.md += ["| " + " | ".join(r) + " |" for r in cells] + [""]


def machine_info(device: str) -> dict:
    info = dict(
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        device=device,
        tokenring=tokenring.__version__,
    )
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=torch.cuda.get_device_name(0),
            cuda=torch.version.cuda,
            gpu_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        )
    return info


class Budget:
    """Wall-clock budget; ``reserve`` seconds of it are kept for the parts after the rank parts."""

    def __init__(self, seconds: float, reserve: float = 0.0):
        self.end, self.reserve = time.monotonic() + seconds, reserve

    def left(self, keep: bool = False) -> float:
        return self.end - time.monotonic() - (self.reserve if keep else 0.0)


_LIVE_POOLS: list = []  # rank pools in use, for the watchdog


def _pool(P: int, budget: Budget):
    from tokenring.tools.launch import RankPool

    pool = RankPool(P, threads=1, timeout=max(30.0, budget.left(keep=True)))
    _LIVE_POOLS.append(pool)
    return pool


def _close(pool) -> None:
    pool.close()
    if pool in _LIVE_POOLS:
        _LIVE_POOLS.remove(pool)


def _watchdog(report: "Report", args, seconds: float) -> None:
    """Last resort against a hang: after ``seconds`` write what there is, stop our ranks, exit 1."""
    import threading

    def fire():
        time.sleep(seconds)
        print(f"\ngpu_check: WATCHDOG: still running after {seconds:.0f} s; stopping (exit 1)", flush=True)
        try:
            for pool in list(_LIVE_POOLS):
                for p in pool._procs:  # the rank processes this script started
                    if p.is_alive():
                        p.kill()
            report.failures.append(f"watchdog: the run exceeded {seconds:.0f} s and was stopped")
            report.data.update(failures=report.failures, goals_missed=report.goals_missed, exit_code=1)
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "results.json"), "w") as f:
                json.dump(report.data, f, indent=1, default=str)
            print("FAILED CHECKS:\n" + "\n".join(f"  - {x}" for x in report.failures), flush=True)
        finally:
            os._exit(1)

    threading.Thread(target=fire, daemon=True, name="gpu_check-watchdog").start()


def _worst(xs: list[float]) -> float:
    """The largest error, NaN if any is NaN (or there is none)."""
    if not xs or any(math.isnan(x) for x in xs):
        return float("nan")
    return max(xs)


def _fmt(x: float, spec: str = ".2e") -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def run_ranks(report: Report, args, sets: dict, budget: Budget, parts: list[str]) -> None:
    """Parts that run on local ranks sharing the device: correctness (P=2 and P=4) and the timeline (P=2)."""
    dev_type = args.device
    ref_dev_type = dev_type
    if dev_type == "cuda":  # float64 reference on the GPU if the P ranks' copies fit comfortably
        free, _ = torch.cuda.mem_get_info(0)
        S, H = sets["S"], max(h for h, _ in HEADS)
        need = 6 * H * S * S * 8 * max(sets["Ps"])
        ref_dev_type = "cuda" if need < 0.4 * free else "cpu"
    do_cases, do_timeline = "correctness" in parts, "timeline" in parts
    sec = report.data["correctness"] = dict(reference_device=ref_dev_type, cases=[], tolerances=TOL)
    Ps = [P for P in sets["Ps"] if do_cases or P == 2]
    if do_timeline and 2 not in Ps:
        report.fail("timeline: not run (needs P=2 ranks)")
    for P in Ps:
        cases = correctness_cases(P, sets["S"], args.quick) if do_cases else []
        batches: dict[str, list[dict]] = {}
        for c in cases:  # one batch per dtype (quick: one batch): progress and a bounded loss if one fails
            batches.setdefault("all" if args.quick else c["dtype"], []).append(c)
        if budget.left(keep=True) < 30:
            report.fail(f"correctness P={P}: not run, out of time budget ({len(cases)} cases)")
            if do_timeline and P == 2:
                report.fail("timeline: not run, out of time budget")
            continue
        t0 = time.perf_counter()
        pool = _pool(P, budget)
        try:
            for key, batch in batches.items():
                left = budget.left(keep=True)
                if left < 20:
                    report.fail(f"correctness P={P} {key}: not run, out of time budget ({len(batch)} cases)")
                    continue
                pool.timeout = left
                try:
                    per_rank = pool.run(
                        correctness_batch, dev_type, ref_dev_type, batch, args.inject_error, sets["timeout"]
                    )
                except Exception as e:  # noqa: BLE001 - a rank died or hung: report, restart, go on
                    report.fail(f"correctness P={P} {key}: the ranks failed: {str(e)[:2000]}")
                    per_rank = [[] for _ in range(P)]
                    _close(pool)
                    pool = _pool(P, budget)
                n_bad = _collect(report, sec, batch, per_rank, P)
                print(
                    f"correctness P={P} {key}: {len(batch)} cases, {n_bad} failed, "
                    f"{time.perf_counter() - t0:.1f} s since the ranks started",
                    flush=True,
                )
                if any("error" in r for rr in per_rank for r in rr):  # ranks may be out of step: fresh ones
                    _close(pool)
                    pool = _pool(P, budget)
            if do_timeline and P == 2:
                run_timeline(report, args, sets, budget, pool)
        finally:
            _close(pool)
    if do_cases:
        _correctness_tables(report, sec)
    else:
        del report.data["correctness"]


def _collect(report: Report, sec: dict, batch: list[dict], per_rank: list[list[dict]], P: int) -> int:
    """Merge the ranks' results per case (worst error over ranks), record and report each failure."""
    by_name: dict[str, list[dict]] = {}
    for rr in per_rank:
        for r in rr or []:
            by_name.setdefault(r["name"], []).append(r)
    bad = 0
    for c in batch:
        rs = by_name.get(c["name"], [])
        tol = TOL[c["dtype"]]
        row = dict(c, tol=tol)
        errors = [f"rank {r['rank']}: {r['error']}" for r in rs if "error" in r]
        if len(rs) < P and not errors:
            errors.append(f"no result from {P - len(rs)} of {P} ranks (batch stopped or ranks failed)")
        elif len(rs) < P:
            errors.append(f"no result from {P - len(rs)} of {P} ranks")
        ok_rs = [r for r in rs if "errors" in r]
        errs = {q: _worst([r["errors"][q] for r in ok_rs]) for q in ("out", "dq", "dk", "dv")}
        problems = [f"rank {r['rank']}: {p}" for r in ok_rs for p in r["problems"]]
        over = [f"{q} rel err {_fmt(e)} > {tol:g}" for q, e in errs.items() if not e <= tol] if ok_rs else []
        row.update(
            errors=errs,
            ok=not (errors or problems or over),
            backward_kernel=sorted({r["backward_kernel"] for r in ok_rs}),
            ran=sorted({r["ran"] for r in ok_rs}),
            seconds=max((r["seconds"] for r in rs), default=None),
        )
        if errors or problems or over:
            row["why"] = "; ".join(errors + problems + over)
            tb = next((r.get("traceback") for r in rs if r.get("traceback")), None)
            if tb:
                row["traceback"] = tb
            report.fail(f"correctness {c['name']}: {row['why'][:600]}")
            bad += 1
        sec["cases"].append(row)
    return bad


def _correctness_tables(report: Report, sec: dict) -> None:
    cases = sec["cases"]
    sec["passed"] = sum(c["ok"] for c in cases)
    sec["failed"] = len(cases) - sec["passed"]
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault((c["P"], c["strategy"], c["dtype"]), []).append(c)
    rows = []
    for (P, strat, dtype), cs in groups.items():
        worst = {q: _worst([c["errors"][q] for c in cs]) for q in ("out", "dq", "dk", "dv")}
        ran = sorted({r for c in cs for r in c["ran"]})
        kern = sorted({k for c in cs for k in c["backward_kernel"]})
        rows.append(
            [
                P,
                strat,
                ", ".join(r for r in ran if r != strat) or "=",
                dtype,
                len(cs),
                sum(c["ok"] for c in cs),
                *(_fmt(worst[q]) for q in ("out", "dq", "dk", "dv")),
                f"{TOL[dtype]:g}",
                "/".join(kern) or "-",
                "PASS" if all(c["ok"] for c in cs) else "FAIL",
            ]
        )
    table(
        report,
        f"1. Correctness vs float64 SDPA (reference on {sec['reference_device']}): worst relative error per group",
        ["P", "strategy", "ran", "dtype", "cases", "passed", "out", "dq", "dk", "dv", "tol", "bwd kernel", "result"],
        rows,
    )
    kern: dict[str, dict[int, set]] = {}
    for c in cases:
        kern.setdefault(c["dtype"], {}).setdefault(c["d"], set()).update(c["backward_kernel"])
    sec["backward_kernels"] = {dt: {str(d): sorted(ks) for d, ks in sorted(v.items())} for dt, v in kern.items()}
    rows = []
    for dt, v in kern.items():
        every = set().union(*v.values())
        rows.append(
            [
                dt,
                ", ".join(f"d={d}: {'/'.join(sorted(ks))}" for d, ks in sorted(v.items())),
                "fused" if "math" not in every else ("math" if every == {"math"} else "mixed"),
            ]
        )
    table(
        report,
        "Backward kernel per dtype and head dim (kernels.pick(q, 'auto', backward=True) on each rank; "
        "math = unfused; on CPU each rank measures its own choice)",
        ["dtype", "kernel", "fused?"],
        rows,
    )
    bad = [c for c in cases if not c["ok"]]
    if bad:
        report.md += ["**Failed cases:**", ""] + [f"- `{c['name']}`: {c['why']}" for c in bad] + [""]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ]


def _sdpa_times(backend, q, k, v, do, causal: bool, scale: float, dev, warmup: int, repeats: int):
    """SDPA with only ``backend`` allowed, on the (B, S, H, d) tensors' transposed views (as the block kernels
    get them): median forward ms (no grad), median backward ms (autograd on a retained graph), its output and
    gradients in (B, S, H, d)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "... kernel not used because ..." from backends that cannot run
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        tf = timed(
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale), dev, warmup, repeats
        )
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal, scale=scale)
        dot = do.transpose(1, 2)
        tb = timed(lambda: torch.autograd.grad(out, leaves, dot, retain_graph=True), dev, warmup, repeats)
        grads = torch.autograd.grad(out, leaves, dot)
    return tf, tb, out.detach().transpose(1, 2), grads


def _our_op(q) -> str:
    """The CUDA op tokenring's block kernels pick for ``q`` (tokenring.kernels.cuda_kernel)."""
    from tokenring.kernels.cuda import cuda_op

    return (cuda_op(q) or "math") if q.device.type == "cuda" else "cpu_flash"


def run_kernels(report: Report, args, sets: dict, budget: Budget) -> None:
    from tokenring.kernels import block_backward, block_forward

    dev = _setup(args.device)
    fused = "cuda" if dev.type == "cuda" else "cpu_flash"
    H, d, dtype = sets["H_kernels"], sets["d_kernels"], torch.bfloat16
    scale = d**-0.5
    w, rep = sets["warmup"], sets["repeats"]
    rows_out, rows = [], []
    for n in sets["seq_kernels"]:
        for causal in (False, True):
            if budget.left() < 15:
                report.fail(f"kernels n={n} causal={causal}: not run, out of time budget")
                continue
            gen = torch.Generator(device=dev).manual_seed(n + causal)
            q, k, v, do = (_randn((1, n, H, d), dtype, dev, gen) for _ in range(4))
            o, lse = block_forward(q, k, v, causal, scale)
            delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
            args = (q, k, v, do, o, lse, delta, causal)
            t_fwd = timed(lambda a=args: block_forward(*a[:3], a[7], scale), dev, w, rep)
            t_bwd = timed(
                lambda a=args: block_backward(a[3], *a[:3], a[5], a[6], a[7], scale, backend=fused, out=a[4]),
                dev,
                w,
                rep,
            )
            ours_grads = block_backward(do, q, k, v, lse, delta, causal, scale, backend=fused, out=o)
            sd: dict[str, dict] = {}
            agree = None
            for name, be in _sdpa_backends():
                try:
                    tf, tb, ref_o, ref_g = _sdpa_times(be, q, k, v, do, causal, scale, dev, w, rep)
                except Exception as e:  # noqa: BLE001 - this backend does not run here: skip it
                    sd[name] = dict(error=str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__)
                    continue
                sd[name] = dict(fwd_ms=tf, bwd_ms=tb)
                if agree is None:  # our kernels must agree with SDPA's (same bf16 inputs)
                    agree = {"vs": name, "out": _rel(o, ref_o, ref_o.abs().max().item())}
                    for nm, ours, theirs in zip(("dq", "dk", "dv"), ours_grads, ref_g):
                        agree[nm] = _rel(ours, theirs, theirs.abs().max().item())
                    if not _worst([agree[x] for x in ("out", "dq", "dk", "dv")]) <= TOL["bfloat16"]:
                        report.fail(
                            f"kernels n={n} causal={causal}: block kernels disagree with SDPA {name}: "
                            + ", ".join(f"{a} rel err {_fmt(agree[a])}" for a in ("out", "dq", "dk", "dv"))
                        )
                del ref_o, ref_g
            flops = 4 * n * n * H * d * (0.5 if causal else 1.0)
            row = dict(
                n=n,
                H=H,
                d=d,
                dtype="bfloat16",
                causal=causal,
                ours_fwd_ms=t_fwd,
                ours_bwd_ms=t_bwd,
                backward_kernel=fused,
                op=_our_op(q),
                sdpa=sd,
                agreement=agree,
            )
            if agree is None:
                report.fail(f"kernels n={n} causal={causal}: no SDPA backend ran, nothing to compare with")
            for pas, ours_ms, fl in (("fwd", t_fwd, flops), ("bwd", t_bwd, 2.5 * flops)):
                ok_be = {b: r[f"{pas}_ms"] for b, r in sd.items() if f"{pas}_ms" in r}
                best = min(ok_be, key=ok_be.get) if ok_be else None
                ratio = ok_be[best] / ours_ms if best else float("nan")
                res = "PASS" if ratio >= KERNEL_GOAL else "FAIL"
                row[pas] = dict(
                    ours_tflops=fl / ours_ms / 1e9,
                    best_sdpa=best,
                    sdpa_tflops=fl / ok_be[best] / 1e9 if best else None,
                    ratio=ratio,
                    goal=res,
                )
                if res == "FAIL":
                    report.miss(
                        f"kernels {pas} n={n} causal={causal}: {ratio:.1%} of SDPA {best} (goal >= {KERNEL_GOAL:.0%})"
                    )
                rows.append(
                    [
                        n,
                        "causal" if causal else "full",
                        pas,
                        f"{ours_ms:.3f}",
                        f"{fl / ours_ms / 1e9:.3g}",
                        best or "-",
                        f"{ok_be[best]:.3f}" if best else "-",
                        f"{fl / ok_be[best] / 1e9:.3g}" if best else "-",
                        _fmt(ratio, ".1%"),
                        res,
                    ]
                )
            rows_out.append(row)
            del q, k, v, do, o, lse, delta, ours_grads
    report.data["kernels"] = dict(rows=rows_out, goal=KERNEL_GOAL)
    table(
        report,
        f"2. Block kernels vs best SDPA backend ({dev.type}, bf16, H={H}, d={d}; goal >= "
        f"{KERNEL_GOAL:.0%}, a miss is a goal, not a correctness failure)",
        ["tokens", "mask", "pass", "ours ms", "ours TFLOP/s", "best SDPA", "SDPA ms", "SDPA TFLOP/s", "ratio", "goal"],
        rows,
    )
    unavailable = {
        f"{r['n']}/{'causal' if r['causal'] else 'full'}: {b}": s["error"]
        for r in rows_out
        for b, s in r["sdpa"].items()
        if "error" in s
    }
    if unavailable:
        report.md += ["SDPA backends that did not run:", ""] + [f"- {k}: {v}" for k, v in unavailable.items()] + [""]


def run_merge(report: Report, args, sets: dict, budget: Budget) -> None:
    from tokenring.kernels import block_forward
    from tokenring.merge import merge_, new_accumulator

    dev = _setup(args.device)
    n, H, d = sets["n_merge"], sets["H_kernels"], sets["d_kernels"]
    scale = d**-0.5
    gen = torch.Generator(device=dev).manual_seed(11)
    q, k, v = (_randn((1, n, H, d), torch.bfloat16, dev, gen) for _ in range(3))
    o, lse = block_forward(q, k, v, False, scale)
    # exactness: merging the partials of two key halves gives the block over all keys
    acc_o, acc_lse = new_accumulator(1, n, H, d, q.dtype, dev)
    for sl in (slice(0, n // 2), slice(n // 2, n)):
        merge_(acc_o, acc_lse, *block_forward(q, k[:, sl], v[:, sl], False, scale))
    err_o = _rel(acc_o, o, o.abs().max().item())
    err_lse = (acc_lse - lse).abs().max().item()
    if not (err_o <= TOL["bfloat16"] and err_lse <= 1e-3):
        report.fail(
            f"merge n={n}: two merged halves differ from one block: out rel err {_fmt(err_o)}, "
            f"lse abs err {_fmt(err_lse)}"
        )
    acc_o, acc_lse = new_accumulator(1, n, H, d, q.dtype, dev)
    merge_(acc_o, acc_lse, o, lse)
    t_merge = timed(lambda: merge_(acc_o, acc_lse, o, lse), dev, sets["warmup"], sets["repeats"])
    t_block = timed(lambda: block_forward(q, k, v, False, scale), dev, sets["warmup"], sets["repeats"])
    t_causal = timed(lambda: block_forward(q, k, v, True, scale), dev, sets["warmup"], sets["repeats"])
    ratio = t_merge / t_block
    res = "PASS" if ratio <= MERGE_GOAL else "FAIL"
    if res == "FAIL":
        report.miss(f"merge n={n}: {ratio:.1%} of one block forward (goal <= {MERGE_GOAL:.0%})")
    report.data["merge"] = dict(
        n=n,
        H=H,
        d=d,
        merge_ms=t_merge,
        block_fwd_ms=t_block,
        block_fwd_causal_ms=t_causal,
        ratio=ratio,
        ratio_vs_causal_block=t_merge / t_causal,
        goal=res,
        exactness=dict(out_rel=err_o, lse_abs=err_lse),
    )
    table(
        report,
        f"3. Merge cost ({dev.type}, bf16 partial into a float32 accumulator, H={H}, d={d}; goal <= "
        f"{MERGE_GOAL:.0%} of one block forward)",
        [
            "tokens",
            "merge ms",
            "block fwd ms",
            "merge/block",
            "causal block ms",
            "merge/causal block",
            "halves merged: out err",
            "lse err",
            "goal",
        ],
        [
            [
                n,
                f"{t_merge:.4f}",
                f"{t_block:.4f}",
                f"{ratio:.1%}",
                f"{t_causal:.4f}",
                f"{t_merge / t_causal:.1%}",
                _fmt(err_o),
                _fmt(err_lse),
                res,
            ]
        ],
    )


def run_timeline(report: Report, args, sets: dict, budget: Budget, pool) -> None:
    from tokenring.tools.trace import plot_timeline, write_chrome_trace

    shape = sets["timeline"]
    sec = report.data["timeline"] = dict(strategy=TIMELINE_STRATEGY, P=2, causal=True, layout="zigzag", **shape)
    if budget.left(keep=True) < 20:
        report.fail("timeline: not run, out of time budget")
        return
    try:
        pool.timeout = max(20.0, min(budget.left(keep=True), 300.0))
        res = pool.run(timeline_rank, args.device, shape, TIMELINE_STRATEGY, sets["timeout"])
    except Exception as e:  # noqa: BLE001
        report.fail(f"timeline: the ranks failed: {str(e)[:2000]}")
        return
    events = [r["events"] for r in res]
    sec.update(wall_s=[r["wall_s"] for r in res], cuda_events=[r["cuda_events"] for r in res])
    rows, stats = [], []
    for phase in ("fwd", "bwd"):
        for rank, evs in enumerate(events):
            ph = [e for e in evs if e["phase"] == phase]
            bad = [
                e for e in ph if not (math.isfinite(e["start"]) and math.isfinite(e["end"]) and e["end"] >= e["start"])
            ]
            st = overlap_stats(ph)
            stats.append(dict(phase=phase, rank=rank, **st))
            if bad or st["n_compute"] == 0 or st["n_messages"] == 0:
                report.fail(
                    f"timeline {phase} rank {rank}: {st['n_compute']} compute / {st['n_messages']} message "
                    f"events, {len(bad)} with bad times"
                )
            rows.append(
                [
                    phase,
                    rank,
                    st["n_compute"],
                    st["n_messages"],
                    f"{st['compute_ms']:.3f}",
                    f"{st['message_ms']:.3f}",
                    f"{st['overlap_ms']:.3f}",
                    f"{st['overlap_frac']:.0%}",
                    f"{st['span_ms']:.3f}",
                ]
            )
    sec["overlap"] = stats
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "timeline.png")
    try:
        panels = {
            f"{TIMELINE_STRATEGY} {phase}, P=2, S={shape['S']}, {shape['dtype']}, H={shape['H']}, "
            f"d={shape['d']}, causal ({args.device})": [[e for e in evs if e["phase"] == phase] for evs in events]
            for phase in ("fwd", "bwd")
        }
        plot_timeline(png, panels, title="tokenring gpu_check timeline: compute (grey) and messages")
        write_chrome_trace(os.path.join(args.out_dir, "timeline.trace.json"), events, title=f"{TIMELINE_STRATEGY} P=2")
        sec["png"] = png
    except Exception as e:  # noqa: BLE001
        report.fail(f"timeline: drawing failed: {type(e).__name__}: {e}")
    if not (os.path.exists(png) and os.path.getsize(png) > 0):
        report.fail(f"timeline: {png} was not written")
    staged = "; gloo stages GPU tensors through host memory" if args.device == "cuda" else ""
    report.deferred.append(
        lambda: (
            table(
                report,
                f"4. Timeline of {TIMELINE_STRATEGY}, P=2 ({args.device}): message time overlapped by compute "
                f"(interval intersection per rank{staged})",
                [
                    "phase",
                    "rank",
                    "computes",
                    "messages",
                    "compute ms",
                    "message ms",
                    "overlapped ms",
                    "overlap",
                    "span ms",
                ],
                rows,
            ),
            report.md.extend(["![timeline](timeline.png)", ""]),
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few cases (what the CPU test runs)")
    ap.add_argument("--out-dir", default=os.path.join("bench", "results", "gpu"))
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="wall-clock budget in seconds: work not started in time is reported as failed, and a "
        "watchdog stops the run 20 s after it (exit 1); default 420",
    )
    ap.add_argument("--parts", default="correctness,kernels,merge,timeline", help=argparse.SUPPRESS)
    ap.add_argument("--inject-error", default=None, nargs="?", const="first", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu --quick for the CPU run)", file=sys.stderr)
        return 1
    t_start = time.perf_counter()
    sets = settings(args.device, args.quick)
    budget = Budget(args.budget_s, reserve=sets["reserve_s"])
    if args.inject_error == "first":  # test hook: corrupt the output of the first case (rank 0)
        args.inject_error = correctness_cases(sets["Ps"][0], sets["S"], args.quick)[0]["name"]
    report = Report(args, sets)
    report.data["machine"] = machine_info(args.device)
    _watchdog(report, args, args.budget_s + 20.0)
    print(
        f"tokenring gpu_check on {report.data['machine'].get('gpu', 'cpu')} (torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}), device={args.device}, quick={args.quick}, out={args.out_dir}",
        flush=True,
    )
    parts = args.parts.split(",")
    steps = [("ranks", lambda *a: run_ranks(*a, parts)), ("kernels", run_kernels), ("merge", run_merge)]
    for name, fn in steps:
        if name not in parts and not (name == "ranks" and {"correctness", "timeline"} & set(parts)):
            continue
        t0 = time.perf_counter()
        try:
            fn(report, args, sets, budget)
        except Exception as e:  # noqa: BLE001 - a crashed part is a failure, the others still run
            report.fail(f"{name}: crashed: {type(e).__name__}: {e}")
            report.data.setdefault("crashes", {})[name] = traceback.format_exc()
            traceback.print_exc()
        report.data.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for show in report.deferred:
        show()
    rc = 1 if report.failures else (2 if report.goals_missed else 0)
    report.data.update(
        failures=report.failures,
        goals_missed=report.goals_missed,
        exit_code=rc,
        wall_s=round(time.perf_counter() - t_start, 1),
    )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(report.data, f, indent=1, default=str)
    m = report.data["machine"]
    head = [
        f"# tokenring GPU check ({report.data['started']})",
        "",
        f"Machine: {m.get('gpu', 'CPU')} ({m.get('gpu_memory_gib', '-')} GiB), torch {m['torch']}, CUDA "
        f"{m.get('cuda', '-')}, cuDNN {m.get('cudnn', '-')}, python {m['python']}; device={args.device}, "
        f"quick={args.quick}; {report.data['wall_s']} s.",
        "",
        f"**Result: {'FAILED' if rc == 1 else ('goals missed' if rc == 2 else 'all passed')} (exit {rc})**",
        "",
    ]
    if report.failures:
        head += ["Failed checks:", ""] + [f"- {x}" for x in report.failures] + [""]
    if report.goals_missed:
        head += ["Performance goals missed:", ""] + [f"- {x}" for x in report.goals_missed] + [""]
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write("\n".join(head + report.md) + "\n")
    print()
    if report.goals_missed:
        print(f"PERFORMANCE GOALS MISSED ({len(report.goals_missed)}):")
        for x in report.goals_missed:
            print(f"  - {x}")
    if report.failures:
        print(f"FAILED CHECKS ({len(report.failures)}):")
        for x in report.failures:
            print(f"  - {x}")
        print(f"gpu_check: FAILED, exit 1 ({report.data['wall_s']} s); results in {args.out_dir}")
    else:
        print(
            f"gpu_check: all correctness checks passed{'; only performance goals missed' if rc == 2 else ''}, "
            f"exit {rc} ({report.data['wall_s']} s); results in {args.out_dir}"
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
