"""``tokenring bench``: every strategy side by side on the same inputs, on P local ranks.

    tokenring bench [--ranks 4] [--seq 4096 ...] [--heads 8] [--kv-heads 8] [--head-dim 64] [--causal]
                    [--pass fwd|bwd|both] [--strategies token_ring ring ulysses ring_bidir pytorch_ring pytorch_cp]
                    [--warmup 1] [--repeats 5] [--json out.json] [--trace-dir DIR]

Each rank is its own process (gloo on CPU; NCCL when CUDA devices are present). Every strategy makes its warm-up
calls, then ``--repeats`` rounds follow, each with one timed call of every strategy (the order rotated from
round to round, so that a drift of the machine reaches all alike and round ``i`` pairs the strategies' calls;
``--sequential``: all of one strategy's calls, then the next's; ``pytorch_cp`` always times its calls in one
block, inside its context manager). Each call starts after a barrier; its time is the slowest rank's. Every
output (and, with a backward, every gradient) is gathered and checked against single-process attention on
the whole sequence. Reported per strategy: median time per call and its spread (min-max), per-step compute,
communication time per step (measured alone: the same schedule and messages with the computes skipped),
exposed (un-overlapped) communication, bytes sent per rank in each direction (``data``: Q / K/V going out;
``results``: partials / dQ / dK/dV coming home; see :mod:`tokenring.messages`), the busiest directed link, and
the ratio to the best. ``--trace-dir`` writes a Chrome trace and a PNG timeline of the median call.

PyTorch's own implementations run as the outside peer:
- ``pytorch_cp``: the public ``torch.distributed.tensor.experimental.context_parallel`` (patched SDPA). On CPU
  only the non-causal forward runs; otherwise it is skipped, saying so. How DTensor executes it depends on the
  shape (torch 2.13 CPU: all-gathered K/V with sequence-sharded output at d=16, but a redistribution to head
  shards, full sequence per rank, at d=64); the result records which (``how``) and the check covers both.
- ``pytorch_ring``: the **private** ``_templated_ring_attention`` / ``_templated_ring_attention_backward``
  with the CPU flash op and the all-to-all rotater (a real K/V ring; round-robin load balance for causal,
  which is our zigzag). Private API: may change with any PyTorch release.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from statistics import median

import torch

from ..device import machine
from ..layouts import default_layout
from ..strategies import STRATEGIES, why_not
from ..strategies import get as get_strategy
from ..strategies.base import ScheduledStrategy
from . import DTYPES
from .launch import init_rank

__all__ = ["run", "launch", "main", "OURS", "PEERS"]

OURS = tuple(STRATEGIES)  # token_ring, ring, ulysses, ring_bidir
PEERS = ("pytorch_ring", "pytorch_cp")


# ----------------------------------------------------------------------------------------------- worker side
def _inputs(spec: dict, device):
    g = torch.Generator().manual_seed(spec["seed"])
    B, S, H, Hkv, d = spec["B"], spec["S"], spec["H"], spec["Hkv"], spec["d"]
    dt = DTYPES[spec["dtype"]]
    q, k, v, do = (torch.randn(B, S, h, d, generator=g) for h in (H, Hkv, Hkv, H))
    return [t.to(device=device, dtype=dt) for t in (q, k, v, do)]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(values: list[float], device) -> list[float]:
    """Element-wise max over ranks."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _comm_only_ops():
    """ForwardOps / BackwardOps whose local kernels only return zeros of the right shapes: running the real
    schedule with them moves exactly the same messages with (next to) no compute to hide behind."""
    from ..merge import acc_dtype
    from ..strategies.base import BackwardOps, ForwardOps

    class Fwd(ForwardOps):
        def block_forward(self, q, k, v, diag):
            B, n, H, _ = q.shape
            return torch.zeros_like(q), torch.zeros(B, H, n, dtype=acc_dtype(q.dtype), device=q.device)

    class Bwd(BackwardOps):
        def block_backward(self, dout, q, k, v, lse, delta, diag, out=None):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return Fwd, Bwd


def _link_bytes(logs_by_rank: list[list]) -> dict:
    """Bytes sent per rank per direction and per directed link, from the comm logs of one call."""
    from .trace import direction

    per_rank, links = [], {}
    for r, logs in enumerate(logs_by_rank):
        sent = {"data": 0, "results": 0}
        for _, records in logs:
            for rec in records:
                if rec["direction"] != "send":
                    continue
                sent[direction(rec["kind"])] += rec["bytes"]
                key = f"{r}->{rec['peer']}"
                links[key] = links.get(key, 0) + rec["bytes"]
        per_rank.append(sent)
    return dict(per_rank=per_rank, links=links, busiest_link=max(links.values(), default=0))


def _model_bytes(spec: dict, name: str) -> dict:
    """PyTorch peers are not traced: bytes from their algorithm (per rank, per call, forward)."""
    P, B, s, Hkv, d = spec["P"], spec["B"], spec["S"] // spec["P"], spec["Hkv"], spec["d"]
    e = DTYPES[spec["dtype"]].itemsize
    kv = 2 * B * s * Hkv * d * e
    fwd = (P - 1) * kv  # ring: K/V to r+1 for P-1 steps; all-gather: every rank's K/V reaches every rank
    sent = {"data": fwd, "results": 0}
    if spec["pass"] != "fwd" and name == "pytorch_ring":
        sent["results"] = P * 2 * B * s * Hkv * d * 4  # float32 dK/dV accumulators rotate every step
        if spec["pass"] == "both":
            sent["data"] += fwd
    return dict(per_rank=[sent] * P, links={}, busiest_link=sent["data"] + sent["results"], model=True)


class _Runner:
    def __init__(self, spec: dict, rank: int, device):
        import torch.distributed as dist

        import tokenring

        self.spec, self.rank, self.device, self.dist, self.tr = spec, rank, device, dist, tokenring
        self.P = spec["P"]
        self.layout = spec["layout"]
        self.full = _inputs(spec, device)
        self.local = [tokenring.shard(t, dim=1, layout=self.layout) for t in self.full]
        self.scale = spec["d"] ** -0.5
        self._variants = {}  # strategy name -> the concrete variant it runs (see _concrete)

    # -- one call of one strategy, timed on this rank; returns (seconds, events, comm log, outputs)
    def _ours(self, name: str, traced: bool):
        from ..comm import Trace
        from ..instrument import instrument

        trace = Trace(self.rank) if traced else None
        log: list = []
        with instrument(
            trace=trace,
            comm_log=log,
            timeout=self.spec["timeout"],
            backward_kernel=self.spec.get("backward_kernel", "auto"),
        ):
            return self._ours_instrumented(name, trace, log)

    def _ours_instrumented(self, name: str, trace, log: list):
        q, k, v, do = self.local
        mode, dist = self.spec["pass"], self.dist
        kw = dict(causal=self.spec["causal"], strategy=name, layout=self.layout)
        grads = None
        if mode == "fwd":
            _sync(self.device)
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = self.tr.attention(q, k, v, **kw)
            _sync(self.device)
            t1 = time.perf_counter()
            split = t1
        else:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            if mode == "bwd":
                out = self.tr.attention(q, k, v, **kw)
                _sync(self.device)
                dist.barrier()
                t0 = split = time.perf_counter()
                out.backward(do)
            else:
                _sync(self.device)
                dist.barrier()
                t0 = time.perf_counter()
                out = self.tr.attention(q, k, v, **kw)
                split = time.perf_counter()
                out.backward(do)
            _sync(self.device)
            t1 = time.perf_counter()
            grads = [q.grad, k.grad, v.grad]
        events = []
        if trace is not None:
            for e in trace.events:
                e["phase"] = "bwd" if e["start"] >= split else "fwd"
                if mode == "bwd" and e["phase"] == "fwd":
                    continue
                events.append(e)
        if mode == "bwd":
            log = [x for x in log if "backward" in x[0]]
        return t1 - t0, events, log, [out.detach()] + ([g for g in grads] if grads else [])

    def _concrete(self, name: str):
        """The variant ``attention(strategy=name)`` runs for these shapes (a family name such as ``token_ring``
        is resolved by the cost model): decided on rank 0, like inside ``attention``, and sent to every rank."""
        from ..api import resolve
        from ..strategies import get

        if name not in self._variants:
            q, k = self.local[:2]
            spec = [None]
            if self.rank == 0:
                spec[0] = resolve(
                    name,
                    q.shape,
                    k.shape,
                    self.P,
                    dtype=q.dtype,
                    causal=self.spec["causal"],
                    layout=self.layout,
                    backward=self.spec["pass"] != "fwd",
                    device_type=self.device.type,
                ).name
            self.dist.broadcast_object_list(spec, src=0)
            self._variants[name] = get(spec[0])
        return self._variants[name]

    def _comm_only(self, name: str):
        """Same schedule, same messages, no compute: the communication time alone."""
        from ..comm import Trace
        from ..executor import execute
        from ..instrument import Instruments
        from ..schedules import Shapes
        from ..strategies.base import Config

        strat = self._concrete(name)
        Fwd, Bwd = _comm_only_ops()
        q, k, v, do = self.local
        B, s, H, d = q.shape
        sh = Shapes(B, s, H, k.shape[2], d, q.dtype, self.P)
        trace = Trace(self.rank)
        cfg = Config(
            group=None,
            rank=self.rank,
            P=self.P,
            causal=self.spec["causal"],
            layout=self.layout,
            scale=self.scale,
            hooks=Instruments(timeout=self.spec["timeout"], trace=trace),
        )
        mode = self.spec["pass"]
        _sync(self.device)
        self.dist.barrier()
        t0 = time.perf_counter()
        split = t0
        if mode in ("fwd", "both"):
            execute(strat.forward_schedule(self.P, self.layout, cfg.causal), cfg.comm("fwd"), Fwd(q, k, v, sh, cfg))
            split = time.perf_counter()
        if mode in ("bwd", "both"):
            stat = torch.zeros(B, H, s, dtype=torch.float32, device=self.device)
            execute(
                strat.backward_schedule(self.P, self.layout, cfg.causal),
                cfg.comm("bwd"),
                Bwd(q, k, v, do, stat, stat, sh, cfg),
            )
        _sync(self.device)
        t1 = time.perf_counter()
        for e in trace.events:
            e["phase"] = "bwd" if (mode == "bwd" or e["start"] >= split) else "fwd"
        return t1 - t0, trace.events

    def _pytorch_ring(self, traced: bool):
        from torch.distributed.tensor.experimental._attention import (
            _cp_options,
            _RotateMethod,
            _templated_ring_attention,
        )
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        causal, mode, dist = self.spec["causal"], self.spec["pass"], self.dist
        old = (_cp_options.rotate_method, _cp_options.enable_load_balance)
        _cp_options.rotate_method = _RotateMethod.ALL_TO_ALL  # a real ring: K/V to r+1 each step
        _cp_options.enable_load_balance = causal and self.layout == "zigzag"  # round-robin == our zigzag
        try:
            q, k, v, do = (t.transpose(1, 2).contiguous() for t in self.local)  # (B, H, s, d)
            fop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
            bop = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
            group = dist.group.WORLD

            def fwd():
                out, lse = _templated_ring_attention(group, 2, fop, q, k, v, is_causal=causal, scale=self.scale)[:2]
                return out, lse

            def bwd(out, lse):
                return _templated_ring_attention_backward(
                    group,
                    2,
                    bop,
                    grad_out=do,
                    grad_out_name="grad_out",
                    query=q,
                    key=k,
                    value=v,
                    out=out,
                    logsumexp=lse,
                    is_causal=causal,
                    dropout_p=0.0,
                    scale=self.scale,
                )[:3]

            grads = None
            if mode == "bwd":
                out, lse = fwd()
            dist.barrier()
            t0 = time.perf_counter()
            if mode != "bwd":
                out, lse = fwd()
            if mode != "fwd":
                grads = bwd(out, lse)
            t1 = time.perf_counter()
        finally:
            _cp_options.rotate_method, _cp_options.enable_load_balance = old
        outs = [out.transpose(1, 2)] + ([g.transpose(1, 2).to(q.dtype) for g in grads] if grads else [])
        return t1 - t0, [], None, outs

    def pytorch_cp_reason(self) -> str | None:
        if self.device.type == "cpu" and (self.spec["causal"] or self.spec["pass"] != "fwd"):
            return (
                "PyTorch's public context_parallel has no CPU sharding rule for causal attention or the "
                "backward (NotImplementedError); only the non-causal forward runs on CPU"
            )
        return None

    def _pytorch_cp(self, repeats: int, warmup: int):
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard

        mesh = init_device_mesh(self.device.type, (self.P,))
        q, k, v = (t.transpose(1, 2).contiguous() for t in self.full[:3])
        gqa = q.shape[1] != k.shape[1]
        times = []
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            for i in range(warmup + repeats):
                _sync(self.device)
                self.dist.barrier()
                t0 = time.perf_counter()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=self.scale, enable_gqa=gqa)
                _sync(self.device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            S, H = self.spec["S"], self.spec["H"]
            if out.shape[2] == S and out.shape[1] == H // self.P:
                # DTensor redistributed to head shards (full sequence, H/P heads): seen on CPU at d=64
                how = "output came back head-sharded (full sequence, H/P heads): DTensor redistributed seq->heads"
                parts = [torch.empty_like(out) for _ in range(self.P)]
                self.dist.all_gather(parts, out.contiguous())
                out_full = torch.cat(parts, dim=1)
                if _cp_options.enable_load_balance and S % (2 * self.P) == 0:
                    # rows are in the head-tail load balancer's order (rank r: chunks r and 2P-1-r) = zigzag
                    from ..layouts import global_order

                    out_full = out_full.index_select(2, torch.argsort(global_order(S, self.P, "zigzag")))
            else:
                how = "output sequence-sharded (K/V all-gathered)"
                (out_full,) = context_parallel_unshard(mesh, [out], [2])
        return times, [out_full.transpose(1, 2)], how

    def _gather(self, outs: list[torch.Tensor], layout: str) -> list[torch.Tensor]:
        return [self.tr.gather(t.contiguous(), dim=1, layout=layout) for t in outs]

    def begin(self, name: str) -> dict:
        """Everything of one strategy before its timed calls: the reason it cannot run here, or its warm-up
        calls. Returns the state :meth:`timed` and :meth:`finish` carry on (``pytorch_cp`` times its calls here,
        inside its one context manager)."""
        spec = self.spec
        res = dict(strategy=name)
        st = dict(res=res, times=[], events=[], last=None, call=None)
        if name == "pytorch_cp":
            reason = self.pytorch_cp_reason()
            if reason:
                res["skipped"] = reason
                return st
            times, outs, how = self._pytorch_cp(spec["repeats"], spec["warmup"])
            res.update(
                api="public torch.distributed.tensor.experimental.context_parallel",
                how=how,
                bytes=_model_bytes(spec, name) if "all-gathered" in how else {},
            )
            res["times"] = _slowest(times, self.device)
            res["full_outputs"] = outs
            return st
        reason = (
            None
            if name in PEERS or name == "auto"
            else why_not(
                name, spec["H"], spec["Hkv"], self.P, spec["S"] // self.P, spec["causal"] and self.layout == "zigzag"
            )
        )
        if reason:
            res["skipped"] = reason
            return st
        if name not in PEERS:
            res["variant"] = self._concrete(name).name  # what a family name such as "token_ring" resolved to
        if name == "pytorch_ring" and self.device.type != "cpu":
            res["skipped"] = "pytorch_ring is wired to the CPU flash op only"
            return st
        st["call"] = (
            (lambda traced: self._pytorch_ring(traced))
            if name == "pytorch_ring"
            else (lambda traced: self._ours(name, traced))
        )
        for _ in range(spec["warmup"]):
            st["call"](False)
        return st

    def timed(self, st: dict) -> None:
        """One timed call of the strategy whose state ``st`` is (nothing if it is skipped or already timed)."""
        if st["call"] is None:
            return
        dt, ev, log, outs = st["call"](self.spec["trace"])
        st["times"].append(dt)
        st["events"].append(ev)
        st["last"] = (log, outs)

    def finish(self, st: dict) -> dict:
        """The strategy's result: times (slowest rank per call), bytes, traces, communication alone, outputs."""
        spec, dist, res, name = self.spec, self.dist, st["res"], st["res"]["strategy"]
        if st["call"] is None:
            return res
        res["times"] = _slowest(st["times"], self.device)
        log, outs = st["last"]
        if name == "pytorch_ring":
            res.update(
                api="private torch.distributed.tensor.experimental._attention._templated_ring_attention"
                " (+ _backward), CPU flash op, all-to-all rotater",
                bytes=_model_bytes(spec, name),
            )
        else:
            logs = [None] * self.P
            dist.all_gather_object(logs, log)
            res["bytes"] = _link_bytes(logs)
        if spec["trace"] and name != "pytorch_ring":
            allev = [None] * self.P
            dist.all_gather_object(allev, st["events"])
            res["events"] = allev  # [rank][repeat] -> events
        if spec["comm_only"] and name not in PEERS and isinstance(self._concrete(name), ScheduledStrategy):
            for _ in range(spec["warmup"]):
                self._comm_only(name)
            ctimes, cev = [], []
            for _ in range(spec["repeats"]):
                dt, ev = self._comm_only(name)
                ctimes.append(dt)
                cev.append(ev)
            res["comm_only_times"] = _slowest(ctimes, self.device)
            allc = [None] * self.P
            dist.all_gather_object(allc, cev)
            res["comm_only_events"] = allc
        res["full_outputs"] = self._gather(outs, self.layout)
        return res

    def run_all(self, names: list[str]) -> list[dict]:
        """Every strategy of ``names``. Interleaved (the default): all warm up, then ``repeats`` rounds of one
        timed call each, the order rotated every round, so that a slow drift of the machine (other tenants,
        clock changes) reaches every strategy alike and round ``i`` of two strategies can be compared as a
        pair; ``spec["interleave"] = False``: one strategy's calls after another's."""
        say = (lambda n: print(f"[bench] {n} ...", file=sys.stderr, flush=True)) if self.rank == 0 else (lambda n: None)
        if not self.spec.get("interleave", True):
            out = []
            for name in names:
                say(name)
                st = self.begin(name)
                for _ in range(self.spec["repeats"]):
                    self.timed(st)
                out.append(self.finish(st))
            return out
        states = []
        for name in names:
            say(name + " (warm-up)")
            states.append(self.begin(name))
        for i in range(self.spec["repeats"]):
            for j in range(len(states)):
                self.timed(states[(i + j) % len(states)])
        return [self.finish(st) for st in states]


def _reference(spec: dict, full: list[torch.Tensor]) -> list[torch.Tensor]:
    """Single-process attention on the whole sequence (float32 or wider), with gradients when needed."""
    import torch.nn.functional as F

    q, k, v, do = (t.detach().to(torch.promote_types(t.dtype, torch.float32)) for t in full)
    need = spec["pass"] != "fwd"
    q, k, v = (t.transpose(1, 2).requires_grad_(need) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=spec["causal"], enable_gqa=q.shape[1] != k.shape[1])
    if not need:
        return [out.transpose(1, 2).detach()]
    out.backward(do.transpose(1, 2))
    return [out.transpose(1, 2).detach()] + [t.grad.transpose(1, 2) for t in (q, k, v)]


def _tolerance(dtype: str) -> float:
    return {"float64": 1e-9, "float32": 2e-4, "bfloat16": 3e-2, "float16": 5e-3}[dtype]


def _check(spec: dict, ref: list[torch.Tensor], outs: list[torch.Tensor]) -> dict:
    names = ["out", "dq", "dk", "dv"]
    errs = {}
    for n, r, o in zip(names, ref, outs):
        scale = max(1.0, r.abs().max().item())
        errs[n] = (o.to(r.dtype) - r).abs().max().item() / scale
    worst = max(errs.values())
    return dict(errors=errs, max_err=worst, tolerance=_tolerance(spec["dtype"]), ok=worst <= _tolerance(spec["dtype"]))


def _summarise(spec: dict, res: dict) -> dict:
    """Reduce raw per-repeat results to medians; keeps the traces of the median call."""
    from .trace import step_metrics

    P = spec["P"]
    times = res.get("times")
    if not times:
        return res
    res["time"] = median(times)
    res["time_min"], res["time_max"] = min(times), max(times)
    res["n_repeats"] = len(times)
    res["per_step"] = res["time"] / P
    ev = res.pop("events", None)
    if ev and ev[0]:
        i = sorted(range(len(times)), key=lambda j: times[j])[len(times) // 2]  # the median call
        per_rank = [ev[r][i] for r in range(P)]
        res["trace_events"] = per_rank
        agg = {}
        for phase in ("fwd", "bwd"):
            ms = [[m for m in step_metrics(per_rank[r]) if m["phase"] == phase] for r in range(P)]
            if not any(ms):
                continue
            n = max(len(x) for x in ms)
            steps = []
            for t in range(n):
                row = [x[t] for x in ms if t < len(x)]
                steps.append(
                    dict(
                        step=t,
                        time=max(m["time"] for m in row),
                        compute=max(m["compute"] for m in row),
                        exposed=max(m["exposed"] for m in row),
                        comm=max(m["comm"] for m in row),
                    )
                )
            compute = median(sum(m["compute"] for m in x) for x in ms)
            exposed = median(sum(m["exposed"] for m in x) for x in ms)
            n_compute = sum(1 for s in steps if s["compute"] > 0)
            agg[phase] = dict(
                steps=steps,
                compute_total=compute,
                exposed_total=exposed,
                compute_steps=n_compute,
                compute_per_step=compute / max(1, n_compute),
                exposed_per_step=exposed / max(1, n_compute),
            )
        res["phases"] = agg
        res["compute_per_step"] = sum(a["compute_total"] for a in agg.values()) / max(
            1, sum(a["compute_steps"] for a in agg.values())
        )
        res["exposed_per_step"] = sum(a["exposed_total"] for a in agg.values()) / max(
            1, sum(a["compute_steps"] for a in agg.values())
        )
    cev = res.pop("comm_only_events", None)
    ct = res.get("comm_only_times")
    if ct:
        res["comm_only_time"] = median(ct)
        i = sorted(range(len(ct)), key=lambda j: ct[j])[len(ct) // 2]
        per_rank = [cev[r][i] for r in range(P)]
        msg_steps = []
        for phase in ("fwd", "bwd"):
            ms = [[m for m in step_metrics(per_rank[r]) if m["phase"] == phase and m["comm"] > 0] for r in range(P)]
            n = max((len(x) for x in ms), default=0)
            msg_steps += [max(x[t]["time"] for x in ms if t < len(x)) for t in range(n)]
        res["comm_steps"] = msg_steps
        res["comm_per_step"] = median(msg_steps) if msg_steps else 0.0
    return res


def _worker(spec_path: str, rank: int) -> int:
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    backend = spec["backend"]
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_rank(rank, spec["P"], spec["store_dir"], backend=backend, threads=spec["threads"], timeout_s=spec["timeout"])
    try:
        if spec.get("fail_rank") == rank:
            raise RuntimeError(f"rank {rank}: failure injected by --fail-rank (testing teardown)")
        import tokenring

        tokenring.set_timeout(spec["timeout"])
        runner = _Runner(spec, rank, device)
        results = runner.run_all(spec["strategies"])
        if rank == 0:
            ref = _reference(spec, [t.cpu() for t in runner.full])
            for r in results:
                outs = r.pop("full_outputs", None)
                if outs is not None:
                    r["check"] = _check(spec, ref, [o.cpu() for o in outs])
                _summarise(spec, r)
            with open(spec["result_path"], "w") as f:
                json.dump(dict(spec=spec, results=results), f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------- launcher
def launch(
    spec: dict,
    *,
    prefix=None,
    env=None,
    workdir: str | None = None,
    timeout: float | None = None,
    module: str = "tokenring.tools.bench",
) -> dict:
    """Run one benchmark case on ``spec['P']`` rank processes and return rank 0's result dict.
    ``module``: whose ``--_worker`` the ranks run (``tokenring.tools.calibrate`` runs a calibration).

    The ranks rendezvous through a file store in ``workdir`` (:func:`tokenring.tools.launch.init_rank`: no
    TCP store, gloo on ``lo`` unless ``env`` sets ``GLOO_SOCKET_IFNAME``). ``prefix(r)`` gives the command
    prefix of rank ``r`` (the testbed passes ``ip netns exec <ns>``: namespaces share the file system) and
    ``env(r)`` extra environment. A rank that fails makes every other rank be stopped (they are our own
    child processes) and raises ``RuntimeError`` with the failing rank's stderr."""
    P = spec["P"]
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tokenring-bench-")
    store_dir = tempfile.mkdtemp(prefix="store-", dir=workdir)  # fresh for every launch in this workdir
    spec = dict(spec, store_dir=store_dir, result_path=os.path.join(workdir, "result.json"))
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    procs, errs = [], []
    # A backstop for a hang the per-operation timeouts miss, so generous: a case of many strategies, repeats and
    # a backward runs for minutes (a P=5 forward+backward of 8 strategies took over 240 s on 2 cores).
    if timeout is None:
        calls = len(spec["strategies"]) * (spec["warmup"] + 2 * spec["repeats"]) * (3 if spec["pass"] == "both" else 1)
        timeout = spec["timeout"] + 120 + 5 * calls
    limit = timeout
    try:
        for r in range(P):
            cmd = list(prefix(r) if prefix else []) + [
                sys.executable,
                "-m",
                module,
                "--_worker",
                spec_path,
                "--_rank",
                str(r),
            ]
            e = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), **(env(r) if env else {}))
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # uninstalled, any cwd
            e["PYTHONPATH"] = os.pathsep.join(x for x in (root, e.get("PYTHONPATH")) if x)
            err = open(os.path.join(workdir, f"rank{r}.err"), "w+")
            errs.append(err)
            procs.append(subprocess.Popen(cmd, env=e, stdout=err, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + limit
        failed = None
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        else:
            failed = -1
        if failed is not None:
            time.sleep(0.5)  # let the others notice and report
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            if failed == -1:
                raise RuntimeError(f"benchmark ranks did not finish within {limit:.0f} s")
            logs = []
            for e in errs:
                e.seek(0)
                logs.append(e.read())
            bad = [r for r, p in enumerate(procs) if p.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL)]
            # The rank that failed first makes its peers fail with "connection closed": report the root cause.
            secondary = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
            primary = [r for r in bad if not any(m in logs[r] for m in secondary)]
            failed = (primary or bad or [failed])[0]
            raise RuntimeError(
                f"benchmark rank {failed} exited with code {procs[failed].returncode} (failed ranks: "
                f"{bad}); its log ends:\n{logs[failed][-3000:]}"
            )
        with open(spec["result_path"]) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for e in errs:
            e.close()
        import shutil

        shutil.rmtree(workdir if own_dir else store_dir, ignore_errors=True)


def _strategy_arg(name: str) -> str:
    if name not in PEERS and name != "auto":
        try:
            get_strategy(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return name


def make_spec(
    P=4,
    S=4096,
    B=1,
    H=8,
    Hkv=None,
    d=64,
    dtype="float32",
    causal=False,
    layout=None,
    mode="fwd",
    strategies=OURS + PEERS,
    warmup=1,
    repeats=5,
    seed=0,
    trace=True,
    comm_only=True,
    threads=1,
    backend=None,
    timeout=120.0,
    fail_rank=None,
    backward_kernel="auto",
    interleave=True,
) -> dict:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else "gloo"
    layout = layout or default_layout(causal)
    return dict(
        P=P,
        S=S,
        B=B,
        H=H,
        Hkv=Hkv or H,
        d=d,
        dtype=dtype,
        causal=causal,
        layout=layout,
        **{"pass": mode},
        strategies=list(strategies),
        warmup=warmup,
        repeats=repeats,
        seed=seed,
        trace=trace,
        comm_only=comm_only,
        threads=threads,
        backend=backend,
        timeout=timeout,
        fail_rank=fail_rank,
        backward_kernel=backward_kernel,
        interleave=interleave,
    )


def run(spec: dict, **launch_kw) -> dict:
    """Run one case; returns ``{"spec", "results", "machine"}`` with medians and checks."""
    out = launch(spec, **launch_kw)
    out["machine"] = machine()
    best = min((r["time"] for r in out["results"] if "time" in r), default=None)
    for r in out["results"]:
        if "time" in r and best:
            r["vs_best"] = r["time"] / best
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    for r in result["results"]:
        if "skipped" in r:
            rows.append([r["strategy"], "skipped: " + r["skipped"]] + [""] * 9)
            continue
        b = r.get("bytes", {})
        pr = b.get("per_rank", [{}])
        data = max((x.get("data", 0) for x in pr), default=None) if b else None
        resl = max((x.get("results", 0) for x in pr), default=None) if b else None
        chk = r.get("check", {})
        rows.append(
            [
                r["strategy"] + (" (private API)" if r["strategy"] == "pytorch_ring" else ""),
                f"{_ms(r['time'])} [{_ms(r['time_min'])}-{_ms(r['time_max'])}]",
                _ms(r.get("per_step")),
                _ms(r.get("compute_per_step")),
                _ms(r.get("comm_only_time")),
                _ms(r.get("exposed_per_step")),
                _mb(data) + ("*" if b.get("model") else ""),
                _mb(resl) + ("*" if b.get("model") else ""),
                _mb(b.get("busiest_link")) + ("*" if b.get("model") else ""),
                f"{r.get('vs_best', 1):.2f}x",
                ("ok " if chk.get("ok") else "FAIL ") + f"{chk.get('max_err', float('nan')):.1e}",
            ]
        )
    return rows


HEADER = [
    "strategy",
    "ms/call median [min-max]",
    "ms/step",
    "compute ms/step",
    "comm ms/call (alone)",
    "exposed ms/step",
    "MB sent data",
    "MB sent results",
    "busiest link MB",
    "vs best",
    "check (max err)",
]


def describe(spec: dict) -> str:
    gqa = "MHA" if spec["H"] == spec["Hkv"] else ("MQA" if spec["Hkv"] == 1 else "GQA")
    return (
        f"P={spec['P']} B={spec['B']} S={spec['S']} (s={spec['S'] // spec['P']}/rank) H={spec['H']} "
        f"Hkv={spec['Hkv']} ({gqa}) d={spec['d']} {spec['dtype']} "
        f"{'causal ' + spec['layout'] if spec['causal'] else 'non-causal'} "
        f"pass={spec['pass']} backend={spec['backend']} repeats={spec['repeats']} (+{spec['warmup']} warm-up"
        f"{', interleaved' if spec.get('interleave', True) else ', sequential'})"
    )


def print_table(result: dict, title: str = "") -> None:
    rows = table_rows(result)
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title or describe(result["spec"]), title_justify="left")
        for h in HEADER:
            t.add_column(h, justify="left" if h == "strategy" else "right")
        for row in rows:
            t.add_row(*row)
        Console(width=200).print(t)
    except ImportError:
        print(title or describe(result["spec"]))
        print(" | ".join(HEADER))
        for row in rows:
            print(" | ".join(row))
    print(
        "* model: bytes from the algorithm (not traced). Times: slowest rank per call; per step = call / P; "
        "comm alone = same schedule with the computes skipped."
    )


def write_traces(result: dict, trace_dir: str, tag: str = "") -> list[str]:
    """Chrome trace per strategy and one PNG with every traced strategy's median call."""
    from .trace import plot_timeline, write_chrome_trace

    os.makedirs(trace_dir, exist_ok=True)
    files, panels = [], {}
    for r in result["results"]:
        ev = r.get("trace_events")
        if not ev:
            continue
        path = os.path.join(trace_dir, f"{tag}{r['strategy']}.trace.json")
        write_chrome_trace(path, ev, title=f"{r['strategy']}: {describe(result['spec'])}")
        files.append(path)
        ran = f" = {r['variant']}" if r.get("variant", r["strategy"]) != r["strategy"] else ""
        panels[f"{r['strategy']}{ran}: {r['time'] * 1e3:.1f} ms/call"] = ev
    if panels:
        path = os.path.join(trace_dir, f"{tag}timeline.png")
        plot_timeline(path, panels, title=describe(result["spec"]))
        files.append(path)
    return files


def compute_floor(**shape) -> float:
    """Seconds of ring's computes per call on unshaped local ranks (the slowest rank's per step, summed): ``P``
    blocks of attention with nothing else, the floor any schedule of these shapes is measured against.
    ``shape``: :func:`make_spec` arguments (``P``, ``S``, ``H``, ``Hkv``, ``causal``, ``mode``, ``repeats``...)."""
    res = run(make_spec(**dict(shape, strategies=["ring"], comm_only=False, trace=True)))
    ring = next(r for r in res["results"] if r["strategy"] == "ring")
    return sum(ph["compute_total"] for ph in ring["phases"].values())


def strip_events(result: dict) -> dict:
    """A copy without the raw trace events (for compact JSON)."""
    out = dict(result)
    out["results"] = [{k: v for k, v in r.items() if k != "trace_events"} for r in result["results"]]
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ranks", "-P", type=int, default=4)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096], help="global sequence length(s); several = sweep")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default=None)
    ap.add_argument("--pass", dest="mode", choices=["fwd", "bwd", "both"], default="fwd")
    ap.add_argument(
        "--strategies",
        nargs="+",
        default=list(OURS + PEERS),
        type=_strategy_arg,
        help=f"any of {', '.join(OURS + PEERS)} or a variant spec such as token_ring:direct,c=2,k=3",
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--backward-kernel",
        default="auto",
        choices=["auto", "math", "cpu_flash", "cuda"],
        help="local backward kernel of this library's strategies (auto: fused where faster)",
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="time one strategy's calls after another's (default: interleaved rounds)",
    )
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--no-comm-only", action="store_true", help="skip measuring communication alone")
    ap.add_argument("--json", default=None, help="write the full results here")
    ap.add_argument("--trace-dir", default=None, help="write Chrome traces and a PNG timeline here")
    ap.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)


def specs_from_args(a) -> list[dict]:
    return [
        make_spec(
            P=a.ranks,
            S=S,
            B=a.batch,
            H=a.heads,
            Hkv=a.kv_heads,
            d=a.head_dim,
            dtype=a.dtype,
            causal=a.causal,
            layout=a.layout,
            mode=a.mode,
            strategies=a.strategies,
            warmup=a.warmup,
            repeats=a.repeats,
            trace=not a.no_trace,
            comm_only=not a.no_comm_only,
            threads=a.threads,
            backend=a.backend,
            timeout=a.timeout,
            fail_rank=a.fail_rank,
            backward_kernel=a.backward_kernel,
            interleave=not a.sequential,
        )
        for S in a.seq
    ]


def run_cases(specs: list[dict], label=lambda s: describe(s), **launch_kw) -> list[dict]:
    """Runs the cases in order, with a progress bar when there is more than one."""
    if len(specs) == 1:
        return [run(specs[0], **launch_kw)]
    try:
        from rich.progress import Progress
    except ImportError:
        return [run(s, **launch_kw) for s in specs]
    out = []
    with Progress(transient=True) as prog:
        task = prog.add_task("bench", total=len(specs))
        for s in specs:
            prog.update(task, description=label(s)[:60])
            out.append(run(s, **launch_kw))
            prog.advance(task)
    return out


def report(results: list[dict], a, title=None, tag=None) -> int:
    """Print each case's table, write traces (``--trace-dir``) and JSON (``--json``); exit code 1 when an
    output did not match the reference. ``title(res)`` / ``tag(res)`` name a case's table and trace files."""
    ok = True
    for res in results:
        print_table(res, title=title(res) if title else None)
        ok &= all(r.get("check", {}).get("ok", True) for r in res["results"])
        if a.trace_dir:
            prefix = tag(res) if tag else (f"S{res['spec']['S']}_" if len(results) > 1 else "")
            for p in write_traces(res, a.trace_dir, prefix):
                print(f"wrote {p}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(cases=results), f, indent=1)
        print(f"wrote {a.json}")
    print("all outputs match single-process attention" if ok else "SOME OUTPUTS DO NOT MATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"]:
        code = _worker(argv[1], int(argv[3]))
        # Leave without interpreter teardown: its result is written and its process group destroyed, and
        # tearing down torch's and gloo's C++ state after that aborted now and then ("terminate called without
        # an active exception", about 1 exit in 4 under pytest, torch 2.13), failing a finished run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ap = argparse.ArgumentParser(prog="tokenring bench", description=__doc__.splitlines()[0])
    add_args(ap)
    a = ap.parse_args(argv)
    try:
        results = run_cases(specs_from_args(a))
    except RuntimeError as e:
        print(f"tokenring bench: {e}", file=sys.stderr)
        return 1
    return report(results, a)


if __name__ == "__main__":
    raise SystemExit(main())
