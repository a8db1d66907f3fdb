"""State passing for recurrent sequence mixers over a sharded sequence: Gated DeltaNet and KDA (delta rules),
Mamba2 (SSD) and short causal convolutions. Each rank runs its own rows from a zero state, the ranks exchange a
summary per fragment whose size does not grow with the sequence, and each rank corrects its rows: exact, with
1/P of the work and memory (docs/DESIGN.md, "Recurrent mixers").

Terms. A *fragment* is a maximal run of consecutive positions held by one rank (zigzag: two per rank). A
*segment* is a maximal run inside one fragment and one document: packed documents start from a zero state. Only
a fragment's first segment can take a state from before it (when it does not begin a document).

The recurrences are affine in their state: over a fragment, ``S_out = A S_in + B``.
- Delta rules keep a ``dk x dv`` state per value head whose columns evolve independently, so one kernel call with
  the values widened by ``dk`` zero columns and the start state ``[0 | I]`` gives both the zero-start outputs and
  ``c_t = q_t A_t`` (the outputs' dependence on the start), and the final state ``[B | A]``. A row's true output
  is ``o_t + c_t S_in``.
- Mamba2's transition is a scalar decay per head: ``A = exp(sum dt*A_log)``, and a row's correction is
  ``exp(cumsum dt*A)_t * (C_t . S_in)``.
- A causal convolution of width ``k`` needs the ``k-1`` inputs before each segment (a halo).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from .layouts import local_positions

__all__ = ["Plan", "plan_for", "delta_rule", "ssd", "causal_conv"]

PACKING_KWARGS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")


@dataclass(frozen=True)
class Plan:
    """This rank's rows cut into segments and fragments, and what its fragments need from the others."""

    rank: int
    P: int
    segments: tuple[tuple[int, int], ...]  # local rows [lo, hi) of each segment, in local order
    first: tuple[int, ...]  # each segment's first global position
    carries: tuple[bool, ...]  # the segment starts inside a document: its start state comes from before it
    frag_segments: tuple[tuple[int, int], ...]  # per local fragment: its first and last segment index
    slots: int  # most fragments a rank holds: the exchange carries this many summaries per rank
    chains: tuple[tuple[tuple[int, int], ...], ...]  # per local fragment: (rank, slot) of the fragments whose
    # summaries fold into its start state, in natural order (the first resets); empty if it starts a document
    last: tuple[tuple[int, int], ...]  # the same chain for the state after the whole sequence
    spans: tuple[tuple[tuple[int, int], tuple[int, int]], ...]  # every rank's fragments: ((rank, slot), (first, last))
    doc_starts: tuple[int, ...]  # where documents start (0 first)
    length: int  # tokens in the whole sequence

    def halo_index(self, width: int) -> torch.Tensor:
        """For a causal convolution of ``width`` (= kernel - 1) inputs before each row: per segment, the
        ``width`` columns before it as indices into the gathered tails ``(P, slots, width)`` flattened, where
        ``P*slots*width`` (one past the end) is a zero column (before the document or the sequence)."""
        return _halo_index(self, width)


def _runs(pos: np.ndarray, starts: np.ndarray) -> list[tuple[int, int]]:
    """Local [lo, hi) runs of consecutive positions, cut again at document starts."""
    if len(pos) == 0:
        return []
    cut = np.flatnonzero((np.diff(pos) != 1) | np.isin(pos[1:], starts)) + 1
    bounds = [0, *cut.tolist(), len(pos)]
    return list(zip(bounds, bounds[1:]))


def build_plan(positions: list[np.ndarray], rank: int, doc_starts=(0,)) -> Plan:
    """The plan of ``rank`` given every rank's global positions (increasing within a rank) and the positions
    where documents start (0 always counts as one)."""
    P = len(positions)
    total = max((int(np.max(p)) + 1 for p in positions if len(p)), default=0)
    starts = np.unique(np.asarray([0, *[d for d in doc_starts if d < total]], dtype=np.int64))
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    by_first: list[tuple[int, int, int]] = []  # (first position, rank, slot)
    for r, pos in enumerate(positions):
        pos = np.asarray(pos, dtype=np.int64)
        if len(pos) and np.any(np.diff(pos) <= 0):
            raise ValueError(f"rank {r}'s positions do not increase")
        frags = _runs(pos, np.empty(0, dtype=np.int64))
        for j, (lo, hi) in enumerate(frags):
            spans[(r, j)] = (int(pos[lo]), int(pos[hi - 1]))
            by_first.append((int(pos[lo]), r, j))
    by_first.sort()
    firsts = [f for f, _, _ in by_first]
    slots = max((j + 1 for (_, j) in spans), default=1)

    def doc_start(p: int) -> int:
        return int(starts[np.searchsorted(starts, p, side="right") - 1])

    def resets(key) -> bool:  # the fragment's end state does not depend on its start state
        a, b = spans[key]
        i = np.searchsorted(starts, a)
        return i < len(starts) and starts[i] <= b

    def chain_before(p: int) -> tuple[tuple[int, int], ...]:
        """Fragments whose summaries give the state just before position ``p`` (empty if ``p`` starts a
        document), oldest (a resetting one) first."""
        out = []
        q = p - 1
        while q >= 0 and q >= doc_start(p):
            i = bisect.bisect_right(firsts, q) - 1
            _, r, j = by_first[i]
            out.append((r, j))
            if resets((r, j)):
                break
            q = spans[(r, j)][0] - 1
        return tuple(reversed(out))

    pos = np.asarray(positions[rank], dtype=np.int64)
    frags = _runs(pos, np.empty(0, dtype=np.int64))
    segments, first, carries, frag_segments, chains = [], [], [], [], []
    for lo, hi in frags:
        i0 = len(segments)
        for a, b in _runs(pos[lo:hi], starts):
            segments.append((lo + a, lo + b))
            first.append(int(pos[lo + a]))
            carries.append(int(pos[lo + a]) not in set(starts.tolist()))
        frag_segments.append((i0, len(segments) - 1))
        chains.append(chain_before(int(pos[lo])) if carries[i0] else ())
    return Plan(
        rank=rank,
        P=P,
        segments=tuple(segments),
        first=tuple(first),
        carries=tuple(carries),
        frag_segments=tuple(frag_segments),
        slots=slots,
        chains=tuple(chains),
        last=chain_before(total) if total > 0 else (),
        spans=tuple(sorted(spans.items())),
        doc_starts=tuple(starts.tolist()),
        length=total,
    )


@lru_cache(maxsize=256)
def plan_for(S: int, P: int, rank: int, layout: str, doc_starts: tuple[int, ...] = (0,)) -> Plan:
    """The plan of ``rank`` for a sequence of ``S`` tokens in ``layout`` (``doc_starts``: where packed documents
    start; the document layouts take their placement from them)."""
    cu = (*sorted(set(doc_starts) | {0}), S)
    positions = [local_positions(S, P, r, layout, "cpu", cu).numpy() for r in range(P)]
    return build_plan(positions, rank, doc_starts)


@lru_cache(maxsize=256)
def _halo_index(plan: Plan, width: int) -> torch.Tensor:
    zero = plan.P * plan.slots * width
    starts = np.asarray(plan.doc_starts)
    by_last = sorted((b, a, key) for key, (a, b) in plan.spans)
    lasts = [b for b, _, _ in by_last]
    rows = []
    for p0 in (*plan.first, plan.length):
        doc = int(starts[np.searchsorted(starts, p0, side="right") - 1])
        row = []
        for q in range(p0 - width, p0):
            if q < doc:
                row.append(zero)
                continue
            b, a, (r, j) = by_last[bisect.bisect_left(lasts, q)]
            back = b - q  # 0 for the fragment's last row
            assert a <= q and back < width, (q, a, b)
            row.append((r * plan.slots + j) * width + width - 1 - back)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long).reshape(len(plan.first) + 1, width)


class _AllGather(torch.autograd.Function):
    """``x`` from every rank, stacked ``(P, *x.shape)``; the gradient sums every rank's share back."""

    @staticmethod
    def forward(ctx, x, group, rank, P):
        parts = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank = group, rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _Tie(torch.autograd.Function):
    """``out`` unchanged, made to depend on ``table``, so that every rank runs the exchange's backward (a rank
    whose rows took nothing from the others would otherwise skip it and leave the others waiting)."""

    @staticmethod
    def forward(ctx, out, table):
        ctx.shape, ctx.dtype = table.shape, table.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)


def _exchange(plan: Plan, group, per_fragment: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's fragment summaries, ``(P, slots, *shape)`` (missing slots are zeros)."""
    shape = per_fragment[0].shape
    mine = torch.stack([*per_fragment, *[per_fragment[0].new_zeros(shape)] * (plan.slots - len(per_fragment))])
    if plan.P == 1:
        return mine[None]
    return _AllGather.apply(mine, group, plan.rank, plan.P)


def _by_length(plan: Plan) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, (lo, hi) in enumerate(plan.segments):
        groups.setdefault(hi - lo, []).append(i)
    return groups


def _run_segments(plan: Plan, run, inputs: list[torch.Tensor], dim: int = 1):
    """``run`` over the segments, those of one length stacked along the batch dim; per segment
    ``(output, final)`` in the segments' order."""
    out: list = [None] * len(plan.segments)
    B = inputs[0].shape[0]
    for _, idx in _by_length(plan).items():
        stacked = [
            torch.cat([x.narrow(dim, plan.segments[i][0], plan.segments[i][1] - plan.segments[i][0]) for i in idx])
            for x in inputs
        ]
        y, final = run(*stacked)
        for n, i in enumerate(idx):
            out[i] = (y[n * B : (n + 1) * B], final[n * B : (n + 1) * B])
    return out


def _state(t: torch.Tensor) -> torch.Tensor:
    """A recurrent state in the precision the fold runs in: float64 stays, anything else is float32."""
    return t if t.dtype == torch.float64 else t.float()


def _fold(table: torch.Tensor, chain, step) -> torch.Tensor | None:
    """The state after ``chain``'s fragments: the first resets; ``step(S, summary)`` applies one more."""
    S = None
    for r, j in chain:
        S = step(S, table[r, j])
    return S


def delta_rule(kernel, plan: Plan, group, q, k, v, g, beta, *, initial_state=None, output_final_state=False, **kw):
    """``kernel`` (a delta-rule kernel: transformers' ``torch_chunk_gated_delta_rule``, FLA's
    ``chunk_gated_delta_rule``, KDA's) over this rank's rows of a sharded sequence, exact. Shapes as the kernel:
    ``q, k (B, s, Hk, dk)``, ``v (B, s, Hv, dv)``, ``g (B, s, Hv[, dk])``, ``beta (B, s, Hv)``; returns the
    kernel's ``(o, final state or None)``, the final state being the whole sequence's, on every rank."""
    if initial_state is not None:
        raise ValueError("a sharded delta-rule layer takes no start state (a cache) in a full-sequence forward")
    for name in PACKING_KWARGS:
        kw.pop(name, None)
    B, _, Hv, dv = v.shape
    dk = k.shape[-1]
    start = torch.zeros(Hv, dk, dv + dk, dtype=torch.float32, device=v.device)
    start[:, :, dv:] = torch.eye(dk, dtype=torch.float32, device=v.device)

    def run(qs, ks, vs, gs, bs):
        wide = torch.cat([vs, vs.new_zeros(*vs.shape[:-1], dk)], dim=-1)
        init = start.expand(qs.shape[0], -1, -1, -1).contiguous()
        return kernel(qs, ks, wide, g=gs, beta=bs, initial_state=init, output_final_state=True, **kw)

    per_seg = _run_segments(plan, run, [q, k, v, g, beta])
    finals = [_state(per_seg[last][1]) for _, last in plan.frag_segments]  # (B, Hv, dk, dv + dk): [B | A]
    table = _exchange(plan, group, finals)

    def step(S, summary):
        b, a = summary[..., :dv], summary[..., dv:]
        return b if S is None else torch.einsum("bhij,bhjv->bhiv", a, S) + b

    outs = []
    for f, (s0, s1) in enumerate(plan.frag_segments):
        S_in = _fold(table, plan.chains[f], step)
        for i in range(s0, s1 + 1):
            o = per_seg[i][0]
            o0, c = o[..., :dv], o[..., dv:]
            if i == s0 and S_in is not None:
                o0 = (o0.to(S_in.dtype) + torch.einsum("bshk,bhkv->bshv", c.to(S_in.dtype), S_in)).to(o.dtype)
            outs.append(o0)
    out = _Tie.apply(torch.cat(outs, dim=1), table)
    final = _fold(table, plan.last, step) if output_final_state else None
    return out, final


def ssd(
    kernel,
    plan: Plan,
    group,
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    **kw,
):
    """``kernel`` (Mamba2's chunked scan: transformers' ``mamba2_chunk_scan`` or mamba_ssm's
    ``mamba_chunk_scan_combined``) over this rank's rows of a sharded sequence, exact. Shapes as the kernel:
    ``x (b, s, h, p)``, ``dt (b, s, h)``, ``A (h,)``, ``B, C (b, s, g, n)``."""
    if initial_states is not None:
        raise ValueError("a sharded Mamba2 layer takes no start state (a cache) in a full-sequence forward")
    for name in PACKING_KWARGS:
        kw.pop(name, None)
    b, _, h, p = x.shape
    n = B.shape[-1]

    def run(xs, dts, Bs, Cs):
        y, final = kernel(
            xs, dts, A, Bs, Cs, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
            return_final_states=True, **kw,
        )  # fmt: skip
        return y, final

    per_seg = _run_segments(plan, run, [x, dt, B, C])

    def log_decay(lo, hi):  # cumsum of dt*A over the rows, as the kernel discretizes them: (b, L, h)
        d = _state(dt[:, lo:hi])
        if dt_bias is not None:
            d = d + dt_bias.to(d.dtype)
        if dt_softplus:
            d = torch.nn.functional.softplus(d)
        d = torch.clamp(d, min=dt_limit[0], max=dt_limit[1])
        return torch.cumsum(d * A.to(d.dtype), dim=1)

    decays = {}
    finals = []
    for f, (s0, s1) in enumerate(plan.frag_segments):
        lo, hi = plan.segments[s1]
        decays[s0] = log_decay(*plan.segments[s0])
        total = decays[s0][:, -1] if s0 == s1 else torch.full((b, h), float("-inf"), device=x.device)
        state = _state(per_seg[s1][1]).reshape(b, h, p * n)
        finals.append(torch.cat([state, total.to(state.dtype).exp()[..., None]], dim=-1))
    table = _exchange(plan, group, finals)

    def step(S, summary):
        state = summary[..., :-1].reshape(b, h, p, n)
        return state if S is None else summary[..., -1, None, None] * S + state

    outs = []
    for f, (s0, s1) in enumerate(plan.frag_segments):
        S_in = _fold(table, plan.chains[f], step)
        for i in range(s0, s1 + 1):
            y = per_seg[i][0]
            if i == s0 and S_in is not None:
                lo, hi = plan.segments[i]
                Cs = C[:, lo:hi].to(S_in.dtype).repeat_interleave(h // C.shape[2], dim=2)
                fix = torch.einsum("bshn,bhpn->bshp", Cs, S_in) * decays[i].to(S_in.dtype).exp()[..., None]
                y = (y.to(S_in.dtype) + fix).to(y.dtype)
            outs.append(y)
    out = _Tie.apply(torch.cat(outs, dim=1), table)
    if return_final_states:
        return out, _fold(table, plan.last, step)
    return out


def causal_conv(conv, plan: Plan, group, x: torch.Tensor, width: int, end: bool = False):
    """``conv(x')`` (a causal convolution over ``(B, C, L)`` of ``width + 1`` taps, zero before its input) over
    this rank's rows ``x (B, C, s)`` of a sharded sequence, exact: each segment gets the ``width`` inputs before
    it (a halo from the rank that holds them; zeros before its document), and one call runs every segment.
    ``end``: also return the sequence's last ``width`` inputs ``(B, C, width)``, the same on every rank."""
    if width == 0:
        return (conv(x), x[:, :, :0]) if end else conv(x)
    Bsz, Cdim, _ = x.shape
    tails = []
    for s0, s1 in plan.frag_segments:
        lo, hi = plan.segments[s0][0], plan.segments[s1][1]
        t = x[:, :, max(lo, hi - width) : hi]
        tails.append(torch.nn.functional.pad(t, (width - t.shape[-1], 0)))
    table = _exchange(plan, group, tails)  # (P, slots, B, C, width)
    flat = table.permute(2, 3, 0, 1, 4).reshape(Bsz, Cdim, -1)
    flat = torch.cat([flat, flat.new_zeros(Bsz, Cdim, 1)], dim=-1)
    halos = flat.index_select(-1, plan.halo_index(width).to(x.device).flatten()).reshape(Bsz, Cdim, -1, width)
    pieces, keep, at = [], [], 0
    for i, (lo, hi) in enumerate(plan.segments):
        pieces += [halos[:, :, i], x[:, :, lo:hi]]
        keep.append(torch.arange(at + width, at + width + hi - lo))
        at += width + hi - lo
    y = conv(torch.cat(pieces, dim=-1))
    out = _Tie.apply(y.index_select(-1, torch.cat(keep).to(y.device)), table)
    return (out, halos[:, :, -1]) if end else out
