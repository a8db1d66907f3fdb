"""``tokenring.calibrate``: measure this group's kernels and links, and give ``auto`` a model of *this* machine
(``set_topology(profile)``, ``profile.save(path)``). What it measures and fits: docs/sim.md, "Calibration".
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import device as _device
from . import settings
from .api import attention
from .comm import exited_ranks, get_timeout, group_store, mark_process, silent_ranks
from .kernels import block_forward
from .schedules import Shapes
from .sim.kernel_model import KernelModel, block_row, fit_table, model_to_dict
from .sim.simulator import simulate
from .sim.topology import (
    INF,
    PROFILE_FORMAT,
    MeshTopology,
    RingTopology,
    SwitchTopology,
    Topology,
    gpu_model,
    profile_summary,
    topology_from_dict,
    topology_to_dict,
)
from .strategies import get as get_strategy

__all__ = ["calibrate", "Profile", "load_profile"]

KINDS = ("mesh", "switch", "ring")


@dataclass
class Profile:
    """What :func:`calibrate` measured: a topology carrying the measured kernel model, the machine, and every
    measurement with its prediction."""

    topology: Topology
    kernel: KernelModel
    machine: dict
    measured: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(
            format=PROFILE_FORMAT,
            topology=topology_to_dict(self.topology),
            kernel=model_to_dict(self.kernel),
            machine=self.machine,
            measured=self.measured,
        )

    def save(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return path

    def summary(self) -> str:
        return profile_summary(self.topology)


def load_profile(path: str) -> Profile:
    with open(path) as f:
        d = json.load(f)
    topo = topology_from_dict(d)
    return Profile(topo, topo.kernel, d.get("machine", {}), d.get("measured", {}))


# ------------------------------------------------------------------------------------------- plumbing
class _Group:
    """Bounded point-to-point and barriers for one calibration, naming a peer that dies or stalls."""

    def __init__(self, group, dev: torch.device):
        self.group, self.dev = group, dev
        self.rank, self.P = dist.get_rank(group), dist.get_world_size(group)
        self.nccl = _device.nccl(group)
        self.timeout = get_timeout()
        self.tag = 7_000_000  # distinct from attention's tags
        self.phase = "start"
        mark_process(group, self.rank)  # for a failure that cannot say which peer is gone (comm.exited_ranks)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def fail(self, peer: int | None, err: Exception) -> RuntimeError:
        who = ""
        store = group_store(self.group)
        if store is not None and peer is None and not self.nccl:  # which peer closed the connection: one gone
            peer = next(iter(exited_ranks(store, [r for r in range(self.P) if r != self.rank], wait_s=1.0)), None)
        if store is not None and peer is not None and not self.nccl:
            try:
                store.set(f"tokenring/stuck/{self.rank}", str(peer))
                who = silent_ranks(store, self.rank, peer, self.P)
            except Exception:
                pass
        return RuntimeError(
            f"tokenring.calibrate: rank {self.rank} failed in {self.phase} "
            f"{f'waiting for rank {peer} of the group ' if peer is not None else ''}within {self.timeout:.0f} s: "
            f"{err}.{who} "
            f"Every rank of the group must call calibrate at once; a rank that died or stopped calling it is the "
            f"cause. The process group cannot be used again after this: destroy it and start the ranks again."
        )

    def new_tag(self) -> int:
        """The next message tag; every rank calls it alike, whether or not it takes part."""
        self.tag += 1
        return self.tag

    def barrier(self) -> None:
        """A bounded dissemination barrier that names a missing peer."""
        z, i = torch.zeros(1, device=self.dev), 1
        while i < self.P:
            tag = self.new_tag()
            self.exchange([((self.rank + i) % self.P, z)], [((self.rank - i) % self.P, torch.empty_like(z))], tag)
            i *= 2

    # peers are ranks of the group (a subgroup, e.g. the context-parallel one of a dp x cp mesh, included)
    def isend(self, buf, dst: int, tag: int):
        return dist.isend(buf, group=self.group, tag=tag, group_dst=dst)

    def irecv(self, buf, src: int, tag: int):
        return dist.irecv(buf, group=self.group, tag=tag, group_src=src)

    def exchange(self, sends, recvs, tag: int) -> float:
        """Post every receive then every send, wait for all; seconds from posting to the last completion."""
        self.sync()
        t0 = time.perf_counter()
        works = [(src, self.irecv(buf, src, tag)) for src, buf in recvs]
        works += [(dst, self.isend(buf, dst, tag)) for dst, buf in sends]
        for peer, w in works:
            try:
                if self.nccl:
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=self.timeout))
            except Exception as e:
                raise self.fail(peer, e) from e
        self.sync()
        return time.perf_counter() - t0

    def gather(self, obj):
        """Every rank's ``obj`` (small, picklable), in rank order."""
        out = [None] * self.P
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _best(g: _Group, fn, repeats: int) -> float:
    """Median of ``repeats`` timed calls (after one untimed), every rank starting each call together."""
    fn()
    times = []
    for _ in range(repeats):
        g.barrier()
        g.sync()
        t = time.perf_counter()
        fn()
        g.sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------- kernels
def _kernel_rows(g: _Group, s: int, H: int, Hkv: int, d: int, dtype, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1234 + g.rank)
    # the shard and its halves / quarters with every head; Ulysses' whole sequence with H / P heads
    sizes = sorted({(max(16, s // 4), H, Hkv), (max(16, s // 2), H, Hkv), (max(16, s), H, Hkv)})
    if H % g.P == 0 and Hkv % g.P == 0:
        sizes.append((s * g.P, H // g.P, Hkv // g.P))
    return [
        block_row(n, h, hkv, d, dtype, causal, lambda fn: _best(g, fn, repeats), gen, g.dev, prefix="k")
        for n, h, hkv in sizes
        for causal in (False, True)
    ]


def _copy_bandwidth(g: _Group, nbytes: int, repeats: int) -> float:
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=g.dev).fill_(1.0)
    y = torch.empty_like(x)
    t = _best(g, lambda: y.copy_(x), repeats)
    return 2 * x.numel() * 4 / t


# ------------------------------------------------------------------------------------------- links
def _buf(g: _Group, nbytes: int) -> torch.Tensor:
    return torch.empty(max(1, nbytes), dtype=torch.uint8, device=g.dev)


def _pattern(g: _Group, flows: list[tuple[int, int]], nbytes: int, repeats: int) -> float:
    """Seconds until every flow ``(src, dst)`` of ``nbytes`` has arrived, all posted at once."""
    me = g.rank
    sends = [(d, _buf(g, nbytes)) for s, d in flows if s == me]
    recvs = [(s, _buf(g, nbytes)) for s, d in flows if d == me]
    times = []
    for _ in range(repeats):
        g.barrier()
        tag = g.new_tag()
        t = g.exchange(sends, recvs, tag) if sends or recvs else 0.0
        times.append(max(g.gather(t)))
    return min(times)


def _pair_alone(g: _Group, src: int, dst: int, nbytes: int, repeats: int) -> float:
    """Seconds from posting ``nbytes`` src -> dst to the sender holding the receiver's 1-byte answer."""
    me, times = g.rank, []
    for _ in range(repeats):
        g.barrier()
        t, there, back = 0.0, g.new_tag(), g.new_tag()
        if me == src:
            t0 = time.perf_counter()
            g.exchange([(dst, _buf(g, nbytes))], [], there)
            g.exchange([], [(dst, _buf(g, 1))], back)
            t = time.perf_counter() - t0
        elif me == dst:
            g.exchange([], [(src, _buf(g, nbytes))], there)
            g.exchange([(src, _buf(g, 1))], [], back)
        times.append(t)
    return max(g.gather(min(times)))  # the sender's


def _patterns(P: int) -> dict[str, list[tuple[int, int]]]:
    pats = {"all_to_all": [(s, d) for s in range(P) for d in range(P) if s != d]}
    for k in range(1, P):
        pats[f"shift_{k}"] = [(s, (s + k) % P) for s in range(P)]
    pats["one_to_all"] = [(0, d) for d in range(1, P)]
    pats["all_to_one"] = [(s, 0) for s in range(1, P)]
    if P > 2:
        pats["exchange_0_1"] = [(0, 1), (1, 0)]
        # every rank to both neighbours at once (ring_bidir's traffic)
        pats["neighbours"] = [(s, (s + k) % P) for s in range(P) for k in (1, P - 1)]
    return pats


def _candidates(P: int, bw: float, lat: float, bp: float, common: dict) -> list[Topology]:
    tag = "" if bp == INF else f"+backplane {bp / 1e6:.4g} MB/s"
    out = [
        MeshTopology("mesh" + tag, P, link_bw=bw, latency=lat, backplane_bw=bp, **common),
        SwitchTopology("switch" + tag, P, port_bw=bw, latency=lat, backplane_bw=bp, **common),
    ]
    if P > 2:
        out.append(RingTopology("ring" + tag, P, link_bw=bw, latency=lat, backplane_bw=bp, **common))
    return out


def _predict(topo: Topology, flows, nbytes: int) -> float:
    src, dst = zip(*flows)
    return float(topo.flow_times(list(src), list(dst), [nbytes] * len(flows)).max())


def _fit_links(P: int, pairs: dict, latency: dict, patterns: dict, nbytes: int, common: dict):
    """The kind (and backplane) whose predictions of the patterns are closest (mean |log ratio|)."""
    bw = statistics.median(pairs.values())
    lat = statistics.median(latency.values())
    flows = _patterns(P)
    # a shared backplane: try each pattern's total rate
    totals = sorted({len(flows[n]) * nbytes / max(t - lat, 1e-9) for n, t in patterns.items()})
    scored = []
    for cand in (c for bp in [INF] + totals for c in _candidates(P, bw, lat, bp, common)):
        err = statistics.mean(abs(math.log(_predict(cand, flows[n], nbytes) / t)) for n, t in patterns.items())
        scored.append((err, cand))
    scored.sort(key=lambda x: x[0])
    return scored


# ------------------------------------------------------------------------------------------- the call
def calibrate(
    group=None,
    *,
    seq: int | None = None,
    heads: int = 8,
    kv_heads: int | None = None,
    head_dim: int = 64,
    dtype=torch.float32,
    device=None,
    repeats: int = 3,
    pair_seconds: float = 0.05,
    message_bytes: int | None = None,
) -> Profile:
    """Measure this group's kernels and links (every rank calls it at once) and return rank 0's
    :class:`Profile` on every rank; shapes as in the calls to come (arguments: docs/sim.md, "Calibration")."""
    t_start = time.perf_counter()
    if not dist.is_initialized():
        raise RuntimeError("tokenring.calibrate needs an initialised process group (init_process_group)")
    dev = torch.device(device) if device is not None else _device.collective_device(group)
    g = _Group(group, dev)
    P = g.P
    kv_heads = kv_heads or heads
    s = max(16, (seq // P) if seq else 1024)
    if P < 2:
        raise ValueError("tokenring.calibrate measures links between ranks: run it on a group of 2 or more ranks")
    try:
        return _calibrate(g, s, heads, kv_heads, head_dim, dtype, repeats, pair_seconds, message_bytes, t_start)
    except RuntimeError as e:
        if str(e).startswith("tokenring.calibrate"):
            raise
        raise g.fail(None, e) from e


def _measure_links(g: _Group, phase, repeats, pair_seconds, message_bytes):
    """Latency per pair, the message size, each pair's rate alone and each traffic pattern's time, in that order."""
    P = g.P
    phase("latency")
    latency = {}
    for a in range(P):
        for b in range(a + 1, P):
            t = _pair_alone(g, a, b, 1, 2 * repeats)
            latency[f"{a}-{b}"] = latency[f"{b}-{a}"] = t / 2
    lat = statistics.median(latency.values())
    phase("bandwidth")
    if message_bytes is None:
        probe = 1 << 20
        t = _pair_alone(g, 0, 1, probe, 2)
        rate = probe / max(t - 2 * lat, 1e-6)
        message_bytes = int(min(256 << 20, max(256 << 10, rate * pair_seconds)))
    nbytes = int(message_bytes)
    pairs = {}
    for a in range(P):
        for b in range(P):
            if a != b:
                t = _pair_alone(g, a, b, nbytes, max(1, repeats - 1))
                pairs[f"{a}-{b}"] = nbytes / max(t - 2 * latency[f"{a}-{b}"], 1e-9)
    phase("patterns")
    patterns = {n: _pattern(g, flows, nbytes, max(1, repeats - 1)) for n, flows in _patterns(P).items()}
    return latency, lat, nbytes, pairs, patterns


def _calibrate(g: _Group, s, H, Hkv, d, dtype, repeats, pair_seconds, message_bytes, t_start) -> Profile:
    P = g.P
    seconds = {}

    def phase(name):
        g.phase = name
        seconds[name] = time.perf_counter()

    # 1. kernels, every rank at once
    phase("kernels")
    rows_all = g.gather(_kernel_rows(g, s, H, Hkv, d, dtype, max(5, repeats)))
    keys = ("k_fwd_ms", "k_fb_ms", "merge_ms")
    rows = [dict(r, **{k: statistics.mean(x[i][k] for x in rows_all) for k in keys}) for i, r in enumerate(rows_all[0])]
    mem_bw = statistics.mean(g.gather(_copy_bandwidth(g, 64 << 20, repeats)))

    # 3. links: latency per pair (ping-pong), then the message size, then each pair alone
    latency, lat, nbytes, pairs, patterns = _measure_links(g, phase, repeats, pair_seconds, message_bytes)

    # 4. compute while an all-to-all is in flight
    phase("overlap")
    per_byte = _compute_per_byte(g, s, H, Hkv, d, dtype, nbytes, repeats)

    # 2. host time per step: a tiny ring call
    phase("step")
    step = _step_time(g, lat)

    phase("calls")
    probes = _measure_calls(g, Shapes(1, s, H, Hkv, d, dtype, P), repeats)
    seconds["end"] = time.perf_counter()
    raw = dict(
        P=P,
        shapes=dict(s=s, H=H, Hkv=Hkv, d=d, dtype=str(dtype).replace("torch.", "")),
        device=_device_name(g.dev),
        gloo=not g.nccl,
        message_bytes=nbytes,
        latency_s=latency,
        pair_Bps=pairs,
        patterns_s=patterns,
        kernel_rows=rows,
        calls_s=probes,
        mem_bw_Bps=mem_bw,
        compute_per_byte_s=per_byte,
        tiny_step_s=step,
        seconds={name: round(t - seconds[name], 3) for name, t in zip(list(seconds), list(seconds.values())[1:])},
        total_s=round(time.perf_counter() - t_start, 3),
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # rank 0's measurements, machine and time on every rank (the step, seconds and clock are each rank's own)
    raw, machine, stamp = g.gather((raw, _machine(g), stamp))[0]
    return fit_profile(raw, machine, stamp)


def _best_by_calls(scored: list, km: KernelModel, sh: Shapes, probes: dict, kinds: list) -> tuple:
    """Among each link family's best candidate, the one whose real calls and patterns are predicted best together."""
    fits, seen = [], set()
    for i, (e, cand) in enumerate(scored):  # each kind's best, without and with a backplane
        family = (type(cand), cand.backplane_bw == INF)
        if family in seen:
            continue
        seen.add(family)
        link, fitted, predicted, call_err = _fit_step(cand, km, sh, probes)
        fits.append((call_err + e, call_err, e, cand, link, fitted, predicted))
        kinds[i]["calls_error"] = round(call_err, 4)
    return min(fits, key=lambda f: f[0])


def _measured(raw: dict, alone: Topology, km: KernelModel, dtype, kinds: list, predicted: dict, link: float) -> dict:
    """The measurements with the fitted model's prediction of each, as kept in the profile."""
    patterns, nbytes, rows, probes = raw["patterns_s"], raw["message_bytes"], raw["kernel_rows"], raw["calls_s"]
    flows = _patterns(raw["P"])
    d, e = raw["shapes"]["d"], dtype.itemsize
    return dict(
        raw,
        patterns={
            n: dict(measured_s=t, predicted_s=_predict(alone, flows[n], nbytes), flows=len(flows[n]))
            for n, t in patterns.items()
        },
        kinds=kinds,
        kernel_rows=[
            dict(
                r,
                model_fwd_ms=km.block_time(r["n"], r["n"], r["hq"], r["hkv"], d, r["causal"], False, e) * 1e3,
                model_bwd_ms=km.block_time(r["n"], r["n"], r["hq"], r["hkv"], d, r["causal"], True, e) * 1e3,
            )
            for r in rows
        ],
        calls={
            n: dict(measured_s=probes[n], predicted_s=predicted[n], factor=km.call_factor(*_probe(n))) for n in probes
        },
        step_s=km.step,
        link_factor=link,
    )


def fit_profile(raw: dict, machine: dict, stamp: str) -> Profile:
    """The profile from what :func:`calibrate` measured (``raw``); deterministic, so every rank fits the same."""
    from dataclasses import replace

    P, shapes = raw["P"], raw["shapes"]
    dtype = getattr(torch, shapes["dtype"])
    sh = Shapes(1, shapes["s"], shapes["H"], shapes["Hkv"], shapes["d"], dtype, P)
    common = dict(
        device=raw["device"],
        cpu_per_byte=raw["compute_per_byte_s"],
        ready_notice=raw["gloo"],
        fair_share=raw["gloo"],
        source="",
    )
    pairs, latency, patterns, nbytes = raw["pair_Bps"], raw["latency_s"], raw["patterns_s"], raw["message_bytes"]
    scored = _fit_links(P, pairs, latency, patterns, nbytes, common)
    kinds = [dict(kind=c.name, error=round(e, 4)) for e, c in scored]
    kname = f"calibrated-{raw['device']}-{shapes['dtype']}-P{P}"
    rows = raw["kernel_rows"]
    km = fit_table(rows, "k", kname, mem_bw=raw["mem_bw_Bps"], source="block kernels timed on every rank at once")
    km = replace(km, add=(km.merge[0] / 4, km.merge[1] / 4), step=raw["tiny_step_s"])
    # real calls decide between the link models that predict the patterns about as well, and fit the step
    probes = raw["calls_s"]
    _, call_err, err, alone, link, km, predicted = _best_by_calls(scored, km, sh, probes, kinds)
    km = replace(km, call_factors=call_factors(probes, predicted))
    topo = scaled_links(alone, link)  # the patterns are predicted by the links alone, calls by the scaled ones
    lat = statistics.median(latency.values())
    label = topo.name
    kind = type(topo).__name__.replace("Topology", "").lower()
    topo.name = f"calibrated:{kind}:{stamp}"
    topo.source = (
        f"tokenring.calibrate on {machine.get('host', '?')} at {stamp}: {P} ranks, pair rate "
        f"{statistics.median(pairs.values()) / 1e6:.4g} MB/s (median of {len(pairs)}), latency {lat * 1e6:.0f} us; "
        f"{label}: mean |log error| {err:.3f} over {len(patterns)} traffic patterns, {call_err:.3f} over "
        f"{len(probes)} real calls with the link rates x{link:.3g} and {km.step * 1e3:.3g} ms per step"
    )
    km = replace(km, source=f"{topo.source}; block kernels timed on every rank at once")
    topo.kernel = km
    measured = _measured(raw, alone, km, dtype, kinds, predicted, link)
    topo.measured = dict(measured, machine=machine)
    return Profile(topo, km, machine, measured)


def refit(profile: dict) -> Profile:
    """Fit a stored profile's measurements again with this version's fitting."""
    m = profile["measured"]
    raw = dict(m)
    raw.setdefault("patterns_s", {n: p["measured_s"] for n, p in m["patterns"].items()})
    raw.setdefault("calls_s", {n: c["measured_s"] for n, c in m["calls"].items()})
    raw.setdefault("device", profile["topology"].get("device", "cpu"))
    raw.setdefault("gloo", bool(profile["topology"].get("ready_notice", True)))
    stamp = profile["topology"]["name"].split(":", 2)[-1]
    return fit_profile(raw, profile.get("machine", {}), stamp)


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return gpu_model(torch.cuda.get_device_name(dev))[0]
    return "cpu"


def _machine(g: _Group) -> dict:
    m = _device.machine()
    m.update(
        threads=torch.get_num_threads(),
        backend=dist.get_backend(g.group),
        gpu=torch.cuda.get_device_name(g.dev) if g.dev.type == "cuda" else None,
        gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
    )
    return m


def _compute_per_byte(g: _Group, s, H, Hkv, d, dtype, nbytes: int, repeats: int) -> float:
    """Extra compute seconds per byte a rank moves, timed while an all-to-all is in flight (mean over ranks)."""
    gen = torch.Generator().manual_seed(99 + g.rank)
    q = torch.randn(1, s, H, d, generator=gen, dtype=dtype).to(g.dev)
    k, v = (torch.randn(1, s, Hkv, d, generator=gen, dtype=dtype).to(g.dev) for _ in range(2))
    fn = lambda: block_forward(q, k, v, False, d**-0.5)
    alone = _best(g, fn, repeats)
    P, me = g.P, g.rank
    extra = []
    for _ in range(max(1, repeats - 1)):
        g.barrier()
        tag = g.new_tag()
        recvs = [g.irecv(_buf(g, nbytes), r, tag) for r in range(P) if r != me]
        sends = [g.isend(_buf(g, nbytes), r, tag) for r in range(P) if r != me]
        done, failed = threading.Event(), []

        def wait_all(works=recvs + sends):  # gloo's works never report completion: a thread waits for them
            try:
                if g.nccl:  # a wait there only orders the stream: poll the works' CUDA events instead
                    deadline = time.monotonic() + g.timeout
                    while not all(w.is_completed() for w in works):
                        if time.monotonic() > deadline:
                            raise TimeoutError("the all-to-all did not complete")
                        time.sleep(1e-4)
                for w in works:
                    w.wait(datetime.timedelta(seconds=g.timeout))
            except Exception as e:
                failed.append(e)
            done.set()

        waiter = threading.Thread(target=wait_all, daemon=True)
        t0, n = time.perf_counter(), 0
        waiter.start()
        while not done.is_set():
            fn()
            g.sync()
            n += 1
        busy = time.perf_counter() - t0
        waiter.join()
        if failed:
            raise g.fail(None, failed[0])
        extra.append(max(0.0, busy - n * alone) / (2 * (P - 1) * nbytes))
    return max(0.0, statistics.mean(g.gather(min(extra))))


def _step_time(g: _Group, lat: float) -> float:
    """Host seconds per schedule step, from a tiny ring call."""
    q = torch.randn(1, 16, 1, 8, device=g.dev)
    fn = lambda: attention(q, q, q, strategy="ring", group=g.group)
    t = _best(g, fn, 5)
    tiny = min(_best(g, lambda: block_forward(q, q, q, False, 8**-0.5), 3), t / g.P)
    return max(0.0, t / g.P - lat - tiny)


STEP_PROBES = (
    "ring",
    "ring_bidir",
    "ulysses",
    "token_ring:relay",
    "token_ring:direct,c=1,k=1",
    "token_ring:direct,c=2,k=1",
    "token_ring:direct,c=4,k=1",
)
MAX_STEP = 0.02  # seconds: a host time per step beyond this means the link model is off, not the host
# the factor on every link rate the real calls may fit (links are slower inside a call)
LINK_RANGE = (0.5, 1.2)


CALL_RANGE = (0.8, 1.25)  # the correction per schedule call_factors allows (a probe gone wrong stays bounded)


CAUSAL_PROBES = ("ring", "token_ring:direct,c=2,k=1", "ulysses")  # also timed causal (zigzag): "causal:<name>"


def _probe(key: str) -> tuple[str, bool]:
    """``(strategy, causal)`` of a probe call's key (``"causal:ring"`` is ring's causal zigzag forward)."""
    causal = key.startswith("causal:")
    return (key[len("causal:") :] if causal else key), causal


def _measure_calls(g: _Group, sh, repeats: int) -> dict:
    """Forward calls of ``STEP_PROBES`` (and ``CAUSAL_PROBES`` causal, zigzag) that run these shapes, at the
    caller's shapes on the group: ``{key: seconds}``, the slowest rank's median."""
    gen = torch.Generator().manual_seed(7 + g.rank)
    q = torch.randn(1, sh.s, sh.H, sh.d, generator=gen, dtype=sh.dtype).to(g.dev)
    k, v = (torch.randn(1, sh.s, sh.Hkv, sh.d, generator=gen, dtype=sh.dtype).to(g.dev) for _ in range(2))
    out = {}
    for key in list(STEP_PROBES) + [f"causal:{n}" for n in CAUSAL_PROBES]:
        name, causal = _probe(key)
        if get_strategy(name).check(sh.H, sh.Hkv, g.P, sh.s, causal) is None and not (causal and sh.s % 2):
            kw = dict(strategy=name, group=g.group, causal=causal, layout="zigzag" if causal else "contiguous")
            t = _best(g, lambda kw=kw: attention(q, k, v, **kw), max(2, repeats - 1))
            out[key] = max(g.gather(t))
    return out


def call_factors(measured: dict, predicted: dict) -> tuple:
    """Per probe, the correction ``auto`` applies to calls with that schedule: the square root of measured /
    predicted, within ``CALL_RANGE`` (why the root: docs/DESIGN.md, Calibration)."""
    lo, hi = CALL_RANGE
    return tuple((n, min(hi, max(lo, math.sqrt(measured[n] / predicted[n])))) for n in measured if predicted[n] > 0)


def scaled_links(topo: Topology, factor: float) -> Topology:
    """``topo`` with every finite rate (links, ports, uplinks, backplane, per flow) times ``factor``."""
    from dataclasses import fields, replace

    kw = {f.name: getattr(topo, f.name) * factor for f in fields(topo) if f.name.endswith("_bw")}
    out = replace(topo, **{k: v for k, v in kw.items() if v < INF})
    out.kernel, out.measured = topo.kernel, topo.measured
    return out


def _fit_step(topo: Topology, km: KernelModel, sh, measured: dict):
    """Host time per step and a factor on every link rate with which the simulator predicts the real calls best:
    ``(link factor, kernel model with the step, {key: predicted seconds}, mean |log error|)``."""
    from dataclasses import replace

    import numpy as np

    names = list(measured)
    m = np.array([measured[n] for n in names])

    def predict(link, step):
        k, t = replace(km, step=step), scaled_links(topo, link)
        return np.array(
            [
                simulate(n, sh, t, k, causal=c, layout="zigzag" if c else "contiguous").time
                for n, c in map(_probe, names)
            ]
        )

    floor = min(km.step, MAX_STEP)  # a real step costs at least what a tiny call's step does
    link, step = 1.0, floor
    for _ in range(3):
        base = predict(link, step)
        cols = [(predict(link, step + 1e-3) - base) / 1e-3, (predict(0.9 * link, step) - base) / (-0.1 * link)]
        A = np.stack(cols, axis=1) / m[:, None]
        delta, *_ = np.linalg.lstsq(A, (m - base) / m, rcond=None)
        step = float(min(MAX_STEP, max(floor, step + delta[0])))
        link = float(min(LINK_RANGE[1], max(LINK_RANGE[0], link + delta[1])))
    after = predict(link, step)
    err = float(np.mean(np.abs(np.log(after / m))))
    return link, replace(km, step=step), dict(zip(names, after.tolist())), err


def calibrate_group(group, q, k) -> None:
    """Calibrate ``group`` for calls shaped like ``q`` / ``k`` and make the profile this process's topology (the
    ``calibrate`` setting: an ``auto`` call's first use of a group)."""
    P = dist.get_world_size(group)
    profile = calibrate(
        group, seq=q.shape[1] * P, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3], dtype=q.dtype
    )
    settings.configure(topology=profile)  # clears the verified signatures and auto's choices on every rank
