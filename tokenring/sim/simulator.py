"""Simulator: runs the executor's schedules on a topology and a kernel model, rank by rank and step by step
(the semantics, and what each topology option adds: docs/sim.md, "The simulator").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import torch

from ..layouts import PLANNED_LAYOUTS, default_layout
from ..messages import Handling
from ..messages import kind as message_kind
from ..schedules import Message, Shapes, message_bytes
from ..strategies import HIERARCHICAL, STRATEGIES
from ..strategies import get as get_strategy
from ..strategies import runnable as runnable_strategies
from .kernel_model import KernelModel, kernel_model
from .topology import Topology

__all__ = [
    "CompiledSchedule",
    "compile_schedule",
    "simulate",
    "simulate_pass",
    "SimResult",
    "PassResult",
    "StepStat",
    "candidates",
    "variant_candidates",
    "fastest",
    "AUTO_STRATEGIES",
]


@dataclass
class CompiledSchedule:
    strategy: str
    P: int
    layout: str
    causal: bool
    backward: bool
    comp_classes: list  # Compute objects with rank 0 / owners canonicalised: (own queries?, the compute)
    msg_classes: list  # (kind, part, heads)
    steps: list  # per step: (comp_rank, comp_cls, msg_src, msg_dst, msg_cls, msg_due, msg_ready) arrays
    deferred: bool = False  # some message is due after the step that posts it
    mask: object = None  # the schedule's tokenring.masks.Mask (documents / window), or None


@lru_cache(maxsize=48)
def compile_schedule(
    strategy: str, P: int, layout: str, causal: bool, backward: bool, mask=None, early: bool = True
) -> CompiledSchedule:
    """The strategy's schedule (exactly what the executor runs) as per-step arrays. ``early=False``: every
    receive posted with its message, ignoring ``Message.ready`` (as the executor does on NCCL)."""
    sched = get_strategy(strategy).schedule(P, layout, causal, backward, mask)
    cc: dict = {}
    mc: dict = {}
    steps = []
    for step in sched.steps:
        cr = np.fromiter((c.rank for c in step.computes), np.int64, len(step.computes))
        # classes of equal cost: rows, heads, own queries (merged locally); under a mask the owners too
        ck = np.fromiter(
            (
                cc.setdefault(
                    (c.q_owner == c.rank, c if mask is not None else replace(c, rank=0, q_owner=0, kv_owner=0)), len(cc)
                )
                for c in step.computes
            ),
            np.int64,
            len(step.computes),
        )
        ms = np.fromiter((m.src for m in step.messages), np.int64, len(step.messages))
        md = np.fromiter((m.dst for m in step.messages), np.int64, len(step.messages))
        mk = np.fromiter(
            (mc.setdefault((m.kind, m.part, m.heads), len(mc)) for m in step.messages), np.int64, len(step.messages)
        )
        du = np.fromiter((len(steps) if m.due < 0 else m.due for m in step.messages), np.int64, len(step.messages))
        rd = np.fromiter((m.receive_step(len(steps), early) for m in step.messages), np.int64, len(step.messages))
        steps.append((cr, ck, ms, md, mk, du, rd))
    deferred = any(bool((st[5] > t).any()) for t, st in enumerate(steps))
    return CompiledSchedule(strategy, P, layout, causal, backward, list(cc), list(mc), steps, deferred, mask)


@dataclass
class StepStat:
    """One step, on its slowest rank: wall time, compute (+ receive handling), longest message, exposed comm."""

    time: float
    compute: float
    comm: float
    exposed: float

    @property
    def bound(self) -> str:
        return "comm" if self.comm > self.compute else "compute"


@dataclass
class PassResult:
    strategy: str
    backward: bool
    time: float  # until the last rank finishes
    compute: float  # busy compute time of the slowest rank
    exposed_comm: float  # its time waiting for messages
    bytes_per_rank: float  # most bytes any rank sends
    steps: list = field(default_factory=list)

    @property
    def regime(self) -> str:
        comm = sum(s.time for s in self.steps if s.bound == "comm")
        return "comm-bound" if comm > 0.5 * self.time else "compute-bound"


@dataclass
class SimResult:
    strategy: str
    topology: str
    shapes: Shapes
    causal: bool
    layout: str
    passes: list  # PassResult, forward then backward (if simulated)
    factor: float = 1.0

    @property
    def time(self) -> float:
        return self.factor * sum(p.time for p in self.passes)

    @property
    def exposed_comm(self) -> float:
        return sum(p.exposed_comm for p in self.passes)

    @property
    def compute(self) -> float:
        return sum(p.compute for p in self.passes)

    @property
    def regime(self) -> str:
        comm = sum(s.time for p in self.passes for s in p.steps if s.bound == "comm")
        return "comm-bound" if comm > 0.5 * sum(p.time for p in self.passes) else "compute-bound"

    def to_dict(self) -> dict:
        return dict(
            strategy=self.strategy,
            topology=self.topology,
            causal=self.causal,
            layout=self.layout,
            shapes=dict(
                B=self.shapes.B,
                s=self.shapes.s,
                H=self.shapes.H,
                Hkv=self.shapes.Hkv,
                d=self.shapes.d,
                dtype=str(self.shapes.dtype).replace("torch.", ""),
                P=self.shapes.P,
            ),
            time_s=self.time,
            call_factor=self.factor,
            compute_s=self.compute,
            exposed_comm_s=self.exposed_comm,
            regime=self.regime,
            passes=[
                dict(
                    backward=p.backward,
                    time_s=p.time,
                    compute_s=p.compute,
                    exposed_comm_s=p.exposed_comm,
                    bytes_per_rank=p.bytes_per_rank,
                    regime=p.regime,
                    step_time_s=[s.time for s in p.steps],
                    step_compute_s=[s.compute for s in p.steps],
                    step_comm_s=[s.comm for s in p.steps],
                )
                for p in self.passes
            ],
        )


def _compute_costs(cs: CompiledSchedule, sh: Shapes, km: KernelModel) -> np.ndarray:
    e = sh.dtype.itemsize
    strategy = get_strategy(cs.strategy)
    out = []
    for own, c in cs.comp_classes:
        dims = strategy.block_dims(c, sh, cs.mask, cs.layout)
        if dims.tiles is None:
            t = km.block_time(dims.rows_q, dims.rows_k, dims.H, dims.Hkv, sh.d, c.diag, cs.backward, e)
        else:  # one kernel call per tile
            t = sum(
                km.block_time(nq, nk, dims.H, dims.Hkv, sh.d, kind == "causal", cs.backward, e)
                for nq, nk, kind in dims.tiles
            )
        t += sum(km.copy_time(b) for b in dims.copies)
        if not dims.copies:  # merging / accumulating the block's results on this rank
            if not cs.backward:
                t += km.merge_time(dims.rows_q * dims.H * sh.d) if own else 0.0
            else:
                t += km.add_time(dims.rows_q * dims.H * sh.d) + km.add_time(2 * dims.rows_k * sh.B * dims.Hkv * sh.d)
        out.append(t)
    return np.array(out)


def _message_costs(cs: CompiledSchedule, sh: Shapes, km: KernelModel) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of each message class, and the receiver's cost of handling one."""
    nbytes, handle = [], []
    spec = get_strategy(cs.strategy).payload
    for kind, part, heads in cs.msg_classes:
        b = message_bytes(Message(0, 1, kind, 0, part, heads), sh, spec)
        nbytes.append(b)
        how = message_kind(kind).handling
        elems = sum(math.prod(shape) for shape, _, seq_dim in spec(kind, part, sh, heads) if seq_dim == 1)
        cost = {Handling.MERGE: km.merge_time, Handling.ADD: km.add_time, Handling.COPY: lambda _: km.copy_time(b)}
        handle.append(cost[how](elems) if how else 0.0)
    return np.array(nbytes, dtype=np.float64), np.array(handle)


def _in_order(pair: np.ndarray, nbytes: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Messages of one step between the same two ranks go one after the other (one connection)."""
    out = dur.copy()
    uniq, inv, counts = np.unique(pair, return_inverse=True, return_counts=True)
    for g in np.nonzero(counts > 1)[0]:
        idx = np.nonzero(inv == g)[0]  # in posting order
        share = np.cumsum(nbytes[idx]) / nbytes[idx].sum()
        out[idx] = dur[idx].max() * share
    return out


class _Shared:
    """Messages in flight per resource, for ``Topology.fair_share`` (processor sharing between connections)."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.flows: dict = {}  # resource -> [(finish, connection)] of the messages crossing it

    def delay(
        self, fi: np.ndarray, ri: np.ndarray, start: np.ndarray, nbytes: np.ndarray, pair: np.ndarray
    ) -> np.ndarray:
        """Seconds each message (``fi`` -> resources ``ri``) waits for other connections' earlier messages."""
        extra = np.zeros(start.size)
        cap = self.topo._cap(ri) if ri.size else ri
        for k in range(fi.size):
            i, r = fi[k], ri[k]
            fl = self.flows.get(int(r))
            if not fl:
                continue
            s, x = start[i], nbytes[i]
            fins = sorted(f for f, p in fl if f > s and p != pair[i])
            if not fins:
                continue
            n, rem, prev, tot = len(fins), 0.0, s, 0.0
            for j, f in enumerate(fins):
                rem += (f - prev) * cap[k] / (n - j)
                prev = f
                tot += min(x, rem)
            extra[i] = max(extra[i], tot / cap[k])
        return extra

    def prune(self, t0: float) -> None:
        """Forget messages done by ``t0`` (no later message starts before it)."""
        for r in list(self.flows):
            fl = [x for x in self.flows[r] if x[0] > t0]
            if fl:
                self.flows[r] = fl
            else:
                del self.flows[r]

    def add(self, fi: np.ndarray, ri: np.ndarray, fin: np.ndarray, pair: np.ndarray) -> None:
        for k in range(fi.size):
            self.flows.setdefault(int(ri[k]), []).append((fin[fi[k]], pair[fi[k]]))


def _grown(res_free: np.ndarray, ri: np.ndarray) -> np.ndarray:
    """``res_free`` (per resource id: when its last message finishes) long enough to index ``ri``."""
    if ri.size and ri.max() >= res_free.size:
        return np.concatenate([res_free, np.zeros(int(ri.max()) + 1 - res_free.size)])
    return res_free


def _notice_plan(cs: CompiledSchedule) -> tuple[dict, list]:
    """Per step: the messages whose receives are posted then, and arrays for their ready notices' arrival."""
    posts: dict = {}
    arrive = []
    for t, st in enumerate(cs.steps):
        rd = st[6] if len(st) > 6 else np.full(st[2].size, t)
        for s in np.unique(rd):
            posts.setdefault(int(s), []).append((t, np.nonzero(rd == s)[0]))
        arrive.append(np.zeros(st[2].size))
    return posts, arrive


def _post_notices(
    notice: tuple[dict, list], s: int, cs: CompiledSchedule, topo: Topology, T: np.ndarray, res_free: np.ndarray
) -> np.ndarray:
    """Ready notices of the receives posted at step ``s``, queued on the reverse routes; returns ``res_free``."""
    posts, arrive = notice
    for t, idx in posts.get(s, []):
        src, dst = cs.steps[t][2][idx], cs.steps[t][3][idx]
        fi, ri = topo.queue_routes(dst, src)
        res_free = _grown(res_free, ri)
        at = T[dst].copy()
        np.maximum.at(at, fi, res_free[ri])
        arrive[t][idx] = at + topo._latency(dst, src)
    return res_free


def _step_compute(cr, ck, ms, md, comp_cost: np.ndarray, km: KernelModel, P: int) -> np.ndarray:
    """Each rank's compute in one step, plus the host's per-step time on ranks with anything to do."""
    comp = np.bincount(cr, weights=comp_cost[ck], minlength=P) if cr.size else np.zeros(P)
    if km.step:  # host time of the step on every rank that computes or posts something in it
        active = np.bincount(cr, minlength=P) + np.bincount(ms, minlength=P) + np.bincount(md, minlength=P)
        comp = comp + km.step * (active > 0)
    return comp


def _message_times(t, ms, md, b, T, P, topo: Topology, notice, pair_free, res_free, shared):
    """When one step's messages finish, queued behind what is still in flight; returns ``(fin, dur, res_free)``."""
    dur = topo.flow_times(ms, md, b)
    # both ends have posted; where the transport waits for the receiver's notice, from when it arrives
    start = np.maximum(T[ms], T[md]) if notice is None else np.maximum(T[ms], notice[1][t])
    pair = ms * P + md  # the connection
    if pair_free is not None:
        start = np.maximum(start, pair_free[pair])
        dur = _in_order(pair, b, dur)
    if res_free is not None:  # the resources still busy with earlier steps' messages
        fi, ri = topo.queue_routes(ms, md)
        res_free = _grown(res_free, ri)
        if shared is None:  # FIFO: wait until they are through
            busy_until = np.zeros(ms.size)
            np.maximum.at(busy_until, fi, res_free[ri])
            start = np.maximum(start, busy_until)
    fin = start + dur
    if shared is not None:  # shared fairly with them instead
        fin = fin + shared.delay(fi, ri, start, b, pair)
        shared.add(fi, ri, fin, pair)
    if res_free is not None:
        np.maximum.at(res_free, ri, fin[fi])
    if pair_free is not None:
        np.maximum.at(pair_free, pair, fin)
    return fin, dur, res_free


def _deliver(t, ms, md, mk, du, fin, end, handle, due_later: dict, P: int) -> np.ndarray:
    """Messages due now end their step on both ranks (``end``, in place); later ones wait in ``due_later``."""
    now = du <= t
    np.maximum.at(end, ms[now], fin[now])
    np.maximum.at(end, md[now], fin[now])
    post = np.bincount(md[now], weights=handle[mk[now]], minlength=P)
    for i in np.nonzero(~now)[0]:
        due_later.setdefault(int(du[i]), []).append((ms[i], md[i], fin[i], handle[mk[i]]))
    return post


def _deliver_late(arrivals: list, end: np.ndarray, post: np.ndarray) -> None:
    """Earlier steps' messages due at this step end it on both ranks (``end``, ``post``, in place)."""
    for src, dst, fin, h in arrivals:
        end[src] = max(end[src], fin)
        end[dst] = max(end[dst], fin)
        post[dst] += h


def simulate_pass(
    cs: CompiledSchedule, sh: Shapes, topo: Topology, km: KernelModel, queued: bool = False
) -> PassResult:
    """One pass of ``cs``; ``queued``: messages also wait behind earlier steps' on shared resources."""
    P = cs.P
    res_free = np.zeros(0) if queued else None  # per resource id: when its last message finishes
    comp_cost = _compute_costs(cs, sh, km)
    nbytes, handle = _message_costs(cs, sh, km)
    T = np.zeros(P)
    busy = np.zeros(P)
    waited = np.zeros(P)
    sent = np.zeros(P)
    steps = []
    # messages due after the step that posts them: (src, dst, finish, handling) per due step
    due_later: dict[int, list] = {}
    pair_free = np.zeros(P * P) if cs.deferred else None
    notice = _notice_plan(cs) if queued and topo.ready_notice else None
    shared = _Shared(topo) if queued and topo.fair_share else None
    for t, st in enumerate(cs.steps):
        cr, ck, ms, md, mk = st[:5]
        du = st[5] if len(st) > 5 else np.full(ms.size, t)
        if shared is not None:
            shared.prune(float(T.min()))
        if notice is not None:  # receives posted now send their ready notices behind what already queues
            res_free = _post_notices(notice, t, cs, topo, T, res_free)
        comp = _step_compute(cr, ck, ms, md, comp_cost, km, P)
        end = T + comp
        comm_t = 0.0
        post = np.zeros(P)
        if ms.size:
            b = nbytes[mk]
            fin, dur, res_free = _message_times(t, ms, md, b, T, P, topo, notice, pair_free, res_free, shared)
            post = _deliver(t, ms, md, mk, du, fin, end, handle, due_later, P)
            out_b = np.bincount(ms, weights=b, minlength=P)
            sent += out_b
            if topo.cpu_per_byte:  # moving bytes costs the computing cores time (CPU hosts)
                cpu = topo.cpu_per_byte * (out_b + np.bincount(md, weights=b, minlength=P))
                comp = comp + cpu
                end = np.maximum(end, T + comp)
            comm_t = float(dur.max())
        _deliver_late(due_later.pop(t, []), end, post)
        new = end + post
        wait = end - (T + comp)
        busy += comp + post
        waited += wait
        r = int(np.argmax(new - T))
        steps.append(StepStat(float(new[r] - T[r]), float(comp[r] + post[r]), comm_t, float(wait[r])))
        T = new
    last = int(np.argmax(T))
    return PassResult(
        cs.strategy,
        cs.backward,
        float(T[last]),
        float(busy[last]),
        float(waited[last]),
        float(sent.max()) if P else 0.0,
        steps,
    )


# what ``auto`` chooses among (bench/results/token_ring_wins.md)
AUTO_STRATEGIES = tuple(st.auto_spec for st in STRATEGIES.values() if not st.hierarchical)


def candidates(H: int, P: int, Hkv: int | None = None, inner=()) -> list[str]:
    """Strategies ``auto`` may pick for these heads on ``P`` ranks (hierarchical ones for node sizes ``inner``)."""
    names = list(AUTO_STRATEGIES) + [
        get_strategy(f).with_inner(n).name for n in inner if 1 < n < P and P % n == 0 for f in HIERARCHICAL
    ]
    return runnable_strategies(H, H if Hkv is None else Hkv, P, names)


def variant_candidates(requested: str, sh: Shapes, causal: bool, layout: str, inner=()) -> list[str]:
    """The concrete strategies ``requested`` may run for these shapes (a family choice: its variants)."""
    fams = candidates(sh.H, sh.P, sh.Hkv, inner) if requested == "auto" else [requested]
    zigzag = causal and layout == "zigzag"
    return [
        v.name
        for f in fams
        for v in get_strategy(f).variants(sh.P)
        if v.check(sh.H, sh.Hkv, sh.P, sh.s, zigzag) is None and not (v.node_rows and layout in PLANNED_LAYOUTS)
    ]


def fastest(results: list[SimResult]) -> SimResult:
    """The fastest prediction; ties (within 0.5%) go to the earlier candidate."""
    best = min(r.time for r in results)
    return next(r for r in results if r.time <= best * 1.005)


def simulate(
    strategy: str,
    shapes: Shapes,
    topology: Topology,
    kernel: KernelModel | None = None,
    *,
    causal: bool = False,
    layout: str | None = None,
    backward: bool = False,
    mask=None,
    queued: bool | None = None,
    early: bool = True,
) -> SimResult:
    """Predict one attention call (``backward=True``: forward + backward) of ``strategy`` on ``topology``.
    ``mask``: packed documents / a window; ``queued``, ``early``: model options (docs/sim.md)."""
    layout = layout or default_layout(causal)
    st = get_strategy(strategy)
    zigzag = causal and layout == "zigzag"
    why = st.check(shapes.H, shapes.Hkv, shapes.P, shapes.s, zigzag)
    if why:
        raise ValueError(why)
    if st.mode == "auto":  # a family choice: its fastest variant (what tokenring.attention would run)
        return fastest(
            [
                simulate(
                    n,
                    shapes,
                    topology,
                    kernel,
                    causal=causal,
                    layout=layout,
                    backward=backward,
                    mask=mask,
                    queued=queued,
                    early=early,
                )
                for n in variant_candidates(strategy, shapes, causal, layout)
            ]
        )
    if topology.P != shapes.P:
        topology = topology.with_P(shapes.P)
    queued = topology.queued if queued is None else queued
    km = kernel or kernel_model(topology.device)
    passes = [
        simulate_pass(
            compile_schedule(strategy, shapes.P, layout, causal, bwd, mask, early), shapes, topology, km, queued
        )
        for bwd in ((False, True) if backward else (False,))
    ]
    return SimResult(strategy, topology.name, shapes, causal, layout, passes, km.call_factor(strategy, causal))


def shapes_for(
    S: int, P: int, H: int, Hkv: int | None = None, d: int = 128, B: int = 1, dtype=torch.bfloat16
) -> Shapes:
    """Per-rank :class:`Shapes` for a global length ``S`` split over ``P`` ranks."""
    if S % P:
        raise ValueError(f"S={S} is not divisible by P={P}")
    return Shapes(B, S // P, H, Hkv or H, d, dtype, P)
