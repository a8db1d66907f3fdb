"""Functions run on every rank of a :class:`tokenring.tools.launch.RankPool`: ``fn(rank, P, *args)``.

Each correctness case builds the full inputs from a seed (identical on all ranks), shards them, runs
``tokenring.attention`` forward and backward, and compares this rank's rows with a float64 single-process
reference computed from the very same (possibly bf16-rounded) inputs.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

import tokenring
from tokenring.layouts import PLANNED_LAYOUTS, local_positions

TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def allowed(S: int, causal: bool, cu_seqlens=None, window=None) -> torch.Tensor:
    """(S, S) bool, written independently of tokenring.masks: query i sees key j when both are in one document
    of ``cu_seqlens``, ``i - left <= j <= i + right`` (-1 unbounded) and, if causal, ``j <= i``."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = torch.ones(S, S, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if cu_seqlens is not None:
        doc = torch.zeros(S, dtype=torch.long)
        for end in cu_seqlens[1:-1]:
            doc[end:] += 1
        ok &= doc[:, None] == doc[None, :]
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
    return ok


def reference(q, k, v, causal: bool, scale: float, cu_seqlens=None, window=None, sinks=None):
    """Plain float64 softmax attention over the whole sequence, (B, S, H, d) layout, GQA by repetition;
    ``sinks`` (H,): one more logit per row and head in the softmax, whose value column is dropped (gpt-oss)."""
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal or cu_seqlens is not None or window is not None:
        s = s.masked_fill(~allowed(q.shape[1], causal, cu_seqlens, window).to(q.device), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1)[..., :-1], vv)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)


def sink_logits(case: dict) -> torch.Tensor | None:
    """The case's attention sinks (H,) in its dtype (seeded apart from the other inputs), or ``None``."""
    if not case.get("sinks"):
        return None
    gen = torch.Generator().manual_seed(1000 + case.get("seed", 0))
    return (torch.randn(case["H"], generator=gen, dtype=torch.float64) * 2).to(getattr(torch, case["dtype"]))


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """Largest error relative to the largest reference value, or to ``floor`` where that is smaller (a rank
    whose reference rows are exactly zero: a query that sees only itself has dq = 0, computed as a difference
    that leaves rounding noise)."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(max(floor, 1e-30))).item()


def case_inputs(rank: int, P: int, case: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The full inputs q, k, v, dO of ``case`` (seeded: identical on every rank; in the case's dtype) and this
    rank's row positions in them."""
    B, s, H, Hkv, d = case["B"], case["s"], case["H"], case["Hkv"], case["d"]
    dtype, S = getattr(torch, case["dtype"]), s * P
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dv = case.get("dv", d)  # a value head dim of its own (MLA)
    full = [
        torch.randn(B, S, h, e, generator=gen, dtype=torch.float64).to(dtype)
        for h, e in ((H, d), (Hkv, d), (Hkv, dv), (H, dv))
    ]
    return full, local_positions(S, P, rank, case["layout"], cu_seqlens=case.get("cu_seqlens"))


def check_case(rank: int, P: int, case: dict, tol: float | None = None, group=None) -> dict:
    """Compare out, dq, dk, dv of one configuration with the reference; raise AssertionError on mismatch
    (``tol``: instead of the dtype's tolerance; ``group``: the P ranks' group, default the world). Every rank
    makes the same collectives whatever its errors, so a rank's mismatch cannot leave the others waiting."""
    d, dtype = case["d"], getattr(torch, case["dtype"])
    causal, layout, strategy, scale = case["causal"], case["layout"], case["strategy"], case.get("scale")
    (*full, dout_full), idx = case_inputs(rank, P, case)
    # Reference in float64 from exactly the inputs the ranks see.
    ref_in = [t.double().clone().requires_grad_() for t in full]
    sinks = sink_logits(case)
    ref_sinks = sinks.double().clone().requires_grad_() if sinks is not None else None
    eff_scale = scale if scale is not None else d**-0.5
    ref_out = reference(*ref_in, causal, eff_scale, case.get("cu_seqlens"), case.get("window"), ref_sinks)
    ref_out.backward(dout_full.double())
    local = [t.index_select(1, idx).clone().requires_grad_() for t in full]
    if sinks is not None:
        sinks.requires_grad_()
    topo = case.get("topology")
    if isinstance(topo, list):  # a different setting per rank: rank 0's choice must still rule
        topo = topo[rank % len(topo)]
    if topo:
        tokenring.set_topology(topo)
        tokenring.forget_choices()  # every rank of this case: decide again under the case's topology
    env = case.get("env") or {}
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with tokenring.instrument(**case.get("config", {})):
            out = tokenring.attention(
                *local,
                causal=causal,
                softmax_scale=scale,
                strategy=strategy,
                layout=layout,
                cu_seqlens=case.get("cu_seqlens"),
                window=case.get("window"),
                inner_size=case.get("inner_size"),
                sinks=sinks,
                group=group,
            )
    finally:
        if topo:
            tokenring.set_topology(None)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    out.backward(dout_full.index_select(1, idx))
    tol = TOL[dtype] if tol is None else tol
    if sinks is not None:  # each rank holds its rows' share of the sinks' gradient: the sum is the whole
        got, size = sinks.grad.double(), sinks.grad.double().abs()
        if P > 1:
            torch.distributed.all_reduce(got, group=group)
            torch.distributed.all_reduce(size, group=group)
        # relative to the sum of the shares' sizes, where larger than the sum: each rank's share is rounded to
        # the dtype before the sum, and shares of both signs cancel (a bf16 DDP reduction does the same)
        dsinks = rel_err(got, ref_sinks.grad, size.max().item())
    errs = {}
    for name, got, ref, like in (
        ("out", out, ref_out, dout_full),
        ("dq", local[0].grad, ref_in[0].grad, local[0]),
        ("dk", local[1].grad, ref_in[1].grad, local[1]),
        ("dv", local[2].grad, ref_in[2].grad, local[2]),
    ):
        assert got is not None and got.dtype == dtype and got.shape[2:] == like.shape[2:], (
            f"rank {rank} {strategy} {case}: {name} has dtype/shape {getattr(got, 'dtype', None)} "
            f"{None if got is None else tuple(got.shape)}"
        )
        r = ref.index_select(1, idx)
        # this rank's rows, relative to at least 1e-3 of the whole and to 0.1 * sqrt(d): the inputs are O(1), and
        # a gradient that is exactly 0 in theory (dq where every query sees only itself: a one-token document, a
        # window of 0) comes out as the rounding noise of (dO.V - delta), dot products of length d
        e = rel_err(got, r, max(1e-3 * ref.abs().max().item(), 0.1 * d**0.5))
        errs[name] = e
        if not (e <= tol):  # also catches NaN
            worst = (got.double() - r).abs().argmax().item()
            raise AssertionError(
                f"rank {rank}/{P} {case}: {name} relative error {e:.3g} > {tol:g} "
                f"(worst flat index {worst}, shape {tuple(got.shape)})"
            )
    if sinks is not None:
        # dsinks sums terms of both signs over every row, each from the bf16-rounded output: bf16 errors reach a
        # few 1e-2 in one process too (3.5e-2 seen), hence 5e-2 there; float32/64 as above
        errs["dsinks"] = e = dsinks
        stol = max(tol, 5e-2) if dtype == torch.bfloat16 else tol
        assert sinks.grad.dtype == dtype and e <= stol, f"rank {rank}/{P} {case}: dsinks relative error {e:.3g}"
    return errs


def check_many(rank: int, P: int, cases: list[dict]) -> int:
    for case in cases:
        check_case(rank, P, case)
    return len(cases)


def comm_log_case(rank: int, P: int, case: dict) -> list:
    """Run forward + backward and return this rank's per-message byte records (forward and backward)."""
    B, s, H, Hkv, d = case["B"], case["s"], case["H"], case["Hkv"], case["d"]
    dtype = getattr(torch, case["dtype"])
    q = torch.randn(B, s, H, d, dtype=dtype, requires_grad=True)
    k = torch.randn(B, s, Hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(B, s, Hkv, d, dtype=dtype, requires_grad=True)
    log: list = []
    with tokenring.instrument(comm_log=log):
        out = tokenring.attention(
            q,
            k,
            v,
            causal=case["causal"],
            strategy=case["strategy"],
            layout=case["layout"],
            cu_seqlens=case.get("cu_seqlens"),
            window=case.get("window"),
        )
    out.sum().backward()
    return [(what, records) for what, records in log]


def expect_error(rank: int, P: int, kind: str) -> str:
    """Call attention with a bad input described by ``kind``; return the error message (must raise)."""
    f = torch.float32
    q, k, v = torch.randn(1, 8, 4, 16, dtype=f), torch.randn(1, 8, 2, 16, dtype=f), torch.randn(1, 8, 2, 16, dtype=f)
    kw: dict = {}
    if kind == "head_ratio":
        q = torch.randn(1, 8, 5, 16, dtype=f)
    elif kind == "batch":
        k, v = torch.randn(2, 8, 2, 16, dtype=f), torch.randn(2, 8, 2, 16, dtype=f)
    elif kind == "length":
        k, v = torch.randn(1, 6, 2, 16, dtype=f), torch.randn(1, 6, 2, 16, dtype=f)
    elif kind == "head_dim":
        k, v = torch.randn(1, 8, 2, 24, dtype=f), torch.randn(1, 8, 2, 24, dtype=f)
    elif kind == "dtype":
        v = v.double()
    elif kind == "device":
        v = v.to("meta")
    elif kind == "ranks_differ":
        n = 8 if rank == 0 else 10
        q, k, v = torch.randn(1, n, 4, 16), torch.randn(1, n, 2, 16), torch.randn(1, n, 2, 16)
    elif kind == "zigzag_odd":
        q, k, v = torch.randn(1, 7, 4, 16), torch.randn(1, 7, 2, 16), torch.randn(1, 7, 2, 16)
        kw = dict(causal=True, layout="zigzag")
    elif kind == "ulysses_heads":
        q = torch.randn(1, 8, 6, 16)
        k, v = torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16)
        kw = dict(strategy="ulysses")
    elif kind == "bidir_odd_kv":
        k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16)
        kw = dict(strategy="ring_bidir")
    elif kind == "bad_strategy":
        kw = dict(strategy="bogus")
    elif kind == "bad_layout":
        kw = dict(layout="striped")
    elif kind == "cu_sum":  # documents that do not add up to the global length 8 * P
        kw = dict(cu_seqlens=[0, 5, 8 * P - 1])
    elif kind == "cu_ranks_differ":
        kw = dict(cu_seqlens=[0, 5 + rank, 8 * P])
    elif kind == "cu_bad_on_one_rank":
        kw = dict(cu_seqlens=[0, 5, 8 * P] if rank else [0, 9, 5, 8 * P])
    elif kind == "window_bad":
        kw = dict(window=(-3, 2))
    elif kind == "inner_missing":  # a hierarchical strategy and no node size anywhere
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        kw = dict(strategy="double_ring")
    elif kind == "inner_indivisible":
        kw = dict(strategy="token_ring_2d", inner_size=P + 1)
    elif kind == "usp_heads":  # 6 query heads do not split over nodes of 4
        q = torch.randn(1, 8, 6, 16)
        k, v = torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16)
        kw = dict(strategy="usp", inner_size=4)
    elif kind == "inner_differ":
        kw = dict(strategy="double_ring", inner_size=2 if rank else 1)
    # Only rank 0 refuses its arguments: it says why, the others that it refused (at once, not after a timeout)
    elif kind == "zigzag_odd_one_rank":
        n = 7 if rank == 0 else 8
        q, k, v = torch.randn(1, n, 4, 16), torch.randn(1, n, 2, 16), torch.randn(1, n, 2, 16)
        kw = dict(causal=True, layout="zigzag")
    elif kind == "bad_strategy_one_rank":
        kw = dict(strategy="bogus" if rank == 0 else "ring")
    elif kind == "chunks_one_rank":
        kw = dict(strategy="token_ring:direct,c=9,k=1" if rank == 0 else "token_ring:direct,c=2,k=1")
    elif kind == "shape_one_rank":
        q = q[0] if rank == 0 else q
    elif kind == "scale_one_rank":
        kw = dict(softmax_scale=float("nan") if rank == 0 else 0.25)
    elif kind == "head_dim_zero":
        q, k, v = q[..., :0], k[..., :0], v[..., :0]
    elif kind == "window_one_rank":
        kw = dict(window=(1.5, 2) if rank == 0 else (1, 2))
    try:
        tokenring.attention(q, k, v, **kw)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: no ValueError for {kind}")


def dead_peer(rank: int, P: int, timeout: float) -> str:
    """Rank P-1 dies in the middle of the second call; the others must get a RuntimeError within the timeout."""
    import os
    import time

    tokenring.set_timeout(timeout)
    q = torch.randn(1, 16, 4, 16)
    tokenring.attention(q, q[:, :, :2], q[:, :, :2], strategy="token_ring")  # first call: signature check
    if rank == P - 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        tokenring.attention(q, q[:, :, :2], q[:, :, :2], strategy="token_ring")
    except RuntimeError as e:
        return f"{time.monotonic() - t0:.3f}|{e}"
    raise AssertionError(f"rank {rank}: no RuntimeError although rank {P - 1} died")


def refuse_later_case(rank: int, P: int, strategy: str, timeout: float) -> tuple[str, float, str]:
    """Every rank agrees on a packed call, then rank 1 alone passes K/V of another head dim on the same call:
    the others go ahead without comparing (they agreed before). ``(error type, seconds, message)``."""
    import time

    tokenring.set_timeout(timeout)
    S = 8 * P
    q, k, v = torch.randn(1, 8, 6, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    kw = dict(strategy=strategy, causal=True, cu_seqlens=[0, 3, S - 5, S])
    tokenring.attention(q, k, v, **kw)
    if rank == 1:
        k, v = k[..., :8], v[..., :8]
    t0 = time.monotonic()
    try:
        tokenring.attention(q, k, v, **kw)
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, time.monotonic() - t0, str(e)
    raise AssertionError(f"rank {rank}: the call went through although rank 1 refused its arguments")


def many_masks_case(rank: int, P: int, keep: int) -> tuple[int, float]:
    """Calls with more new masks than the verified-signature cache keeps (``keep`` per group), then the first
    masks again: every rank drops and re-exchanges alike. ``(entries kept, largest error vs. one process)``."""
    from tokenring import ops
    from tokenring.layouts import shard

    size, ops._checked.size = ops._checked.size, keep
    try:
        S, worst = 16 * P, 0.0
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, S, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        for cut in (3, 5, 7, 9, 11, 3, 5):
            cu = [0, cut, S]
            out = tokenring.attention(*(shard(x) for x in (q, k, v)), causal=True, cu_seqlens=cu, layout="contiguous")
            want = shard(reference(q, k, v, True, 8**-0.5, cu))
            worst = max(worst, (out - want).abs().max().item())
        return len(ops._checked.groups[next(iter(ops._checked.groups))]), worst
    finally:
        ops._checked.size = size


def peak_memory_case(rank: int, P: int, s: int, H: int, d: int, strategy: str) -> int:
    """Peak resident memory growth (bytes) of one causal forward+backward at local length ``s``, after a
    small warm-up call so that one-time allocations (kernel libraries, thread pools, gloo buffers) are not
    counted."""
    import resource

    def call(n):
        torch.manual_seed(rank)
        q, k, v = (torch.randn(1, n, H, d, requires_grad=True) for _ in range(3))
        tokenring.attention(q, k, v, causal=True, strategy=strategy).sum().backward()

    call(256)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    call(s)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def scale_of(d: int) -> float:
    return 1.0 / math.sqrt(d) * 0.7


def subgroup_case(rank: int, P: int, strategy: str) -> float | None:
    """Attention inside a sub-group of the odd ranks (group ranks differ from global ranks); returns the max
    abs error of the gathered output against the float64 reference (None on ranks outside the group)."""
    import torch.distributed as dist

    sub = dist.new_group([r for r in range(P) if r % 2 == 1])  # collective: every rank creates it
    if rank % 2 == 0:
        return None
    Ps = dist.get_world_size(sub)
    x = torch.randn(2, 4 * Ps, 4, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    local = tokenring.shard(x, dim=1, layout="zigzag", group=sub).requires_grad_()
    out = tokenring.attention(local, local, local, causal=True, strategy=strategy, group=sub)
    out.sum().backward()
    full = tokenring.gather(out.detach(), dim=1, layout="zigzag", group=sub)
    ref_in = x.clone().requires_grad_()
    ref = reference(ref_in, ref_in, ref_in, True, 8**-0.5)
    ref.sum().backward()
    grad_ref = tokenring.shard(ref_in.grad, dim=1, layout="zigzag", group=sub)
    return max((full - ref).abs().max().item(), (local.grad - grad_ref).abs().max().item())


def chosen_strategy(rank: int, P: int, topology: str, strategy: str) -> str:
    """Which strategy ran (from the byte log's name) when this rank set ``topology`` (rank 0 decides)."""
    tokenring.set_topology(topology)
    tokenring.forget_choices()  # on every rank: this pool's earlier cases agreed the signature already
    try:
        q = torch.randn(1, 64, 4, 16, dtype=torch.float64)
        log: list = []
        with tokenring.instrument(comm_log=log):
            tokenring.attention(q, q, q, strategy=strategy)
        return log[0][0]
    finally:
        tokenring.set_topology(None)


def chosen_strategy_mixed(rank: int, P: int, strategy: str) -> str:
    return chosen_strategy(rank, P, "mesh:100mbit" if rank == 0 else "switch:10gbit", strategy)


def held_case(rank: int, P: int, strategy: str, s: int, causal: bool) -> list:
    """Bytes of visiting data held after each step (forward and backward) of one call on this rank."""
    H, d = 4, 16
    layout = "zigzag" if causal else "contiguous"
    q, k, v = (torch.randn(1, s, H, d, dtype=torch.float32, requires_grad=True) for _ in range(3))
    held: list = []
    with tokenring.instrument(held_log=held):
        out = tokenring.attention(q, k, v, causal=causal, strategy=strategy, layout=layout)
    out.sum().backward()
    return [(what, max(xs)) for what, xs in held]


class _Coalesced:
    """One work standing for a whole batch, as NCCL returns from ``batch_isend_irecv``."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


def coalesced_case(rank: int, P: int, case: dict) -> dict:
    """``check_case`` with each step's operations posted in one batch and ``batch_isend_irecv`` returning one
    coalesced work for it (NCCL's behaviour), and, as on NCCL, every receive posted at its message's step (no
    early receives: a coalesced work would wait for a receive whose send comes steps later)."""
    import torch.distributed as dist

    from tokenring.comm import Comm

    real, init = dist.batch_isend_irecv, Comm.__init__

    def nccl_like(self, *args, **kw):
        init(self, *args, **kw)
        self.early_receives, self.batched = False, True

    dist.batch_isend_irecv = lambda ops: [_Coalesced(real(ops))]
    Comm.__init__ = nccl_like
    try:
        return check_case(rank, P, case)
    finally:
        dist.batch_isend_irecv, Comm.__init__ = real, init


def staged_case(rank: int, P: int, case: dict) -> tuple[dict, list]:
    """``check_case`` with every message staged through host buffers; returns the errors and the
    ``staged`` flag of every message record."""
    log: list = []
    errs = check_case(rank, P, dict(case, config=dict(stage="always", comm_log=log)))
    return errs, [r["staged"] for _, recs in log for r in recs]


def stop_case(rank: int, P: int, strategy: str, how: str, phase: str, timeout: float):
    """Rank P-1 stops in the second call, in its ``phase`` ("forward" or "backward"): ``how="dead"`` exits,
    ``"silent"`` stays alive without calling (sleeps past the others' bound). Every other rank returns (seconds
    from the start of that pass to its RuntimeError, the message); the silent rank returns ``None``."""
    import os
    import time

    tokenring.set_timeout(timeout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, h, 8, generator=g).requires_grad_() for h in (6, 2, 2))
    tokenring.attention(q, k, v, strategy=strategy).sum().backward()  # first call: signatures verified

    def stop():
        if how == "dead":
            os._exit(0)
        # silent: back in the pool's loop after this, alive and not calling, until the others have answered
        time.sleep(timeout + 1)

    victim = rank == P - 1
    try:
        if victim and phase == "forward":
            return stop()
        t0 = time.monotonic()
        out = tokenring.attention(q, k, v, strategy=strategy)
        if victim:
            return stop()
        t0 = time.monotonic()
        out.sum().backward()
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError(f"rank {rank}: no RuntimeError although rank {P - 1} stopped ({how}, {phase})")


def gone_before_posting_case(rank: int, P: int, strategy: str, timeout: float):
    """Rank P-1 exits after the first call; the others call again once its connections are closed, so posting
    to it can fail at once, before any wait. Every other rank returns (seconds to its RuntimeError, message)."""
    import os
    import time

    tokenring.set_timeout(timeout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, h, 8, generator=g) for h in (6, 2, 2))
    tokenring.attention(q, k, v, strategy=strategy)  # first call: signatures verified, marks left
    if rank == P - 1:
        os._exit(0)
    time.sleep(0.5)
    return _failure(rank, P, lambda: tokenring.attention(q, k, v, strategy=strategy))


def _failure(rank: int, P: int, call) -> tuple[float, str]:
    """Seconds until ``call()`` raises its RuntimeError (rank P-1 having exited), and the message."""
    import time

    t0 = time.monotonic()
    try:
        call()
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError(f"rank {rank}: no RuntimeError although rank {P - 1} exited")


def decode_stop_case(rank: int, P: int, timeout: float, check: bool):
    """Rank P-1 exits inside a decode step (at its gather of the partials, after the step's check when
    ``check``); every other rank returns (seconds to its RuntimeError, message)."""
    from tokenring.tools.launch import exit_at_step

    tokenring.set_timeout(timeout)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    k, v = (torch.randn(1, 10, 2, 8, generator=g) for _ in range(2))
    tokenring.decode_attention(q, k, v, check=check)
    if rank == P - 1:
        exit_at_step("decode", 0)
    return _failure(rank, P, lambda: tokenring.decode_attention(q, k, v, check=check))


def absent_case(rank: int, P: int, timeout: float):
    """Rank P-1 never calls attention (its first call, so the shapes are not verified yet); the others return the
    RuntimeError message they get within the timeout."""
    import time

    tokenring.set_timeout(timeout)
    if rank == P - 1:
        time.sleep(timeout + 1)  # then alive in the pool's loop, not calling, until the others have answered
        return None
    try:
        tokenring.attention(*(torch.randn(1, 8, 2, 8) for _ in range(3)))
    except RuntimeError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: no error although rank {P - 1} never called")


def _call(rank: int, P: int, case: dict):
    """One forward + backward of ``case`` (seeded full inputs, this rank's shard): out, dq, dk, dv, and the
    float64 reference rows of out."""
    full, idx = case_inputs(rank, P, case)
    q, k, v = (t.index_select(1, idx).clone().requires_grad_() for t in full[:3])
    out = tokenring.attention(q, k, v, causal=case["causal"], strategy=case["strategy"], layout=case["layout"])
    out.backward(full[3].index_select(1, idx))
    ref = reference(*(t.double() for t in full[:3]), case["causal"], case["d"] ** -0.5).index_select(1, idx)
    return [out.detach(), q.grad, k.grad, v.grad], ref


def refusal_then_call(rank: int, P: int, kinds: list, case: dict) -> dict:
    """A valid call, then each refused call of ``kinds`` (a ValueError here) followed by the valid call again:
    {kind: the outputs and gradients after it are bit for bit those before}, and the valid call's error
    against the float64 reference."""
    before, ref = _call(rank, P, case)
    same = {}
    for kind in kinds:
        expect_error(rank, P, kind)
        after, _ = _call(rank, P, case)
        same[kind] = all(torch.equal(x, y) for x, y in zip(before, after))
    return dict(same=same, err=rel_err(before[0].double(), ref))


def repeat_case(rank: int, P: int, case: dict) -> bool:
    """Two calls on the same inputs give bitwise-identical outputs and gradients on this rank."""
    a, _ = _call(rank, P, case)
    b, _ = _call(rank, P, case)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def bf16_rms_case(rank: int, P: int, case: dict, mutant: bool) -> tuple[float, float]:
    """(sum of squared errors, sum of squared reference values) of this rank's bf16 output against float64.
    ``mutant``: the running accumulator is rounded to bf16 after every merge (what the float32 merge avoids)."""
    import tokenring.strategies.tensor_ops as base  # (where the Ops' merges run)

    real = base.merge_, base.merge_seen_  # (without a mask the forward merges with merge_seen_)
    if mutant:

        def rounding(merge):
            def rounded(acc_o, acc_lse, o, lse):
                merge(acc_o, acc_lse, o, lse)
                acc_o.copy_(acc_o.to(torch.bfloat16))

            return rounded

        base.merge_, base.merge_seen_ = (rounding(m) for m in real)
    try:
        (out, *_), ref = _call(rank, P, case)
    finally:
        base.merge_, base.merge_seen_ = real
    return float(((out.double() - ref) ** 2).sum()), float((ref**2).sum())


def kill_at_step_case(
    rank: int, P: int, strategy: str, causal: bool, phase: str, victim: int, step: int, timeout: float
):
    """The victim rank exits at the start of ``step`` of its ``phase`` pass; the others return (seconds from the
    start of the pass they failed in, message), or ``"completed"`` if they needed nothing more from it."""
    import time

    from tokenring.tools.launch import exit_at_step

    tokenring.set_timeout(timeout)
    layout = "zigzag" if causal else "contiguous"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, h, 8, generator=g).requires_grad_() for h in (12, 2, 2))
    tokenring.attention(q, k, v, causal=causal, strategy=strategy, layout=layout).sum().backward()
    if rank == victim:
        exit_at_step(phase, step)
    t0 = time.monotonic()
    try:
        out = tokenring.attention(q, k, v, causal=causal, strategy=strategy, layout=layout)
        t0 = time.monotonic()
        out.sum().backward()
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    return "completed"


def decode_case(rank: int, P: int, case: dict) -> tuple[list, float]:
    """A cache of ``n`` rows dealt to the ranks unevenly, ``t`` new tokens placed by ``place_new``, queries
    attending all cached rows and the new ones causally: this rank's output (as a list, for bitwise comparison
    across ranks) and its error against a float64 single-process reference."""
    from tokenring.decode import decode_attention, place_new

    B, n, t, H, Hkv, d = case["B"], case["n"], case["t"], case["H"], case["Hkv"], case["d"]
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(case.get("seed", 0))
    k_all, v_all = (torch.randn(B, n + t, Hkv, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    q = torch.randn(B, t, H, d, generator=g, dtype=torch.float64).to(dtype)
    cuts = sorted(torch.randint(0, n + 1, (P - 1,), generator=g).tolist())  # uneven, possibly empty shards
    bounds = [0] + cuts + [n]
    counts = [bounds[r + 1] - bounds[r] for r in range(P)]
    a, b = place_new(counts, t)[rank]
    rows = list(range(bounds[rank], bounds[rank + 1])) + list(range(n + a, n + b))
    k, v = k_all[:, rows], v_all[:, rows]
    scale = case.get("scale", d**-0.5)
    window = case.get("window")  # query n + i sees keys at most `window` positions back
    out = decode_attention(
        q,
        k,
        v,
        new=(a, b),
        state=(n,),
        softmax_scale=case.get("scale"),
        window=window,
        positions=torch.arange(bounds[rank], bounds[rank + 1]) if window is not None else None,
        start=n,
    )
    # reference: query i (global position n + i) sees every cached row and new rows j <= i
    ok = torch.ones(t, n + t, dtype=torch.bool)
    ok[:, n:] = torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:
        ok &= torch.arange(n + t)[None, :] >= torch.arange(n, n + t)[:, None] - window
    kk, vv = (x.double().repeat_interleave(H // Hkv, 2) for x in (k_all, v_all))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~ok, float("-inf")), -1), vv)
    return out.double().flatten().tolist(), rel_err(out, ref)


def decode_mismatch(rank: int, P: int) -> str:
    """Rank 0 decodes a different number of new tokens: every rank must raise ValueError."""
    from tokenring.decode import decode_attention

    t = 2 if rank == 0 else 1
    q, k = torch.randn(1, t, 4, 8), torch.randn(1, 5, 2, 8)
    try:
        decode_attention(q, k, k.clone(), state=(5,))
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: no ValueError")


def silent_case(rank: int, P: int, strategy: str, victim: int, when: str, timeout: float):
    """Rank ``victim`` stops: ``when="first"`` never makes its first call (alive, sleeping), ``"later"`` makes a
    first call and then never the second, ``"dead"`` exits before the second. The others return (seconds from
    the start of the call that failed to its RuntimeError, the message)."""
    import os
    import time

    tokenring.set_timeout(timeout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, h, 8, generator=g).requires_grad_() for h in (4, 4, 4))
    if when != "first":
        tokenring.attention(q, k, v, strategy=strategy).sum().backward()
    if rank == victim:
        if when == "dead":
            os._exit(0)
        time.sleep(timeout + 1)  # then alive in the pool's loop, not calling, until the others have answered
        return None
    t0 = time.monotonic()
    try:
        tokenring.attention(q, k, v, strategy=strategy).sum().backward()
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError(f"rank {rank}: no RuntimeError although rank {victim} stopped ({when})")


def extend_case(rank: int, P: int, case: dict) -> float:
    """``n`` cached rows dealt to the ranks unevenly and in shuffled positions, ``T`` new tokens split by
    ``split_new`` (or the ranges ``case["ranges"]``), every strategy of ``tokenring.extend``: this rank's error
    against a float64 single-process reference in which new token ``i`` (position ``n + i``) sees every cached
    row and the new tokens up to itself (within ``window`` / its document, if given). With ``later``: then as a
    model's later layers call it (``shards=``, ``state=None``) three times, the third a replay straight from the
    call's memo (``extend._repeats``), and once by the step loop: the same bits each time."""
    from tokenring import program
    from tokenring.extend import Shards, extend_attention, split_new

    B, n, T, H, Hkv, d = (case[x] for x in ("B", "n", "T", "H", "Hkv", "d"))
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(case.get("seed", 0))
    k_all, v_all = (torch.randn(B, n + T, Hkv, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    q_all = torch.randn(B, T, H, d, generator=g, dtype=torch.float64).to(dtype)
    order = torch.randperm(n, generator=g)  # which cached positions each rank holds: any, in any order
    cuts = sorted(torch.randint(0, n + 1, (P - 1,), generator=g).tolist())
    bounds = [0] + cuts + [n]
    counts = [bounds[r + 1] - bounds[r] for r in range(P)]
    ranges = case.get("ranges", split_new(counts, T))
    a, b = ranges[rank]
    mine = order[bounds[rank] : bounds[rank + 1]]
    rows = mine.tolist() + list(range(n + a, n + b))
    window, cu = case.get("window"), case.get("cu_seqlens")
    sinks = torch.linspace(-1.5, 2.0, H, dtype=torch.float64).to(dtype) if case.get("sinks") else None
    import tokenring.strategies.extend as ext

    old_rows, ext.BATCH_ROWS = ext.BATCH_ROWS, case.get("batch_rows", ext.BATCH_ROWS)  # groups of query rows
    runs, replays, real = [], [0], program.replay_on
    later = dict(shards=Shards(tuple(c + y - x for c, (x, y) in zip(counts, ranges)), tuple(ranges)), state=None)

    def counted(*args):
        replays[0] += 1
        return real(*args)

    calls = [(False, {})] * (1 + bool(case.get("replay"))) + [(False, later)] * 3 * bool(case.get("later"))
    calls += [(True, later if case.get("later") else {})] * bool(case.get("replay") or case.get("later"))
    program.replay_on = counted
    try:  # with "replay": replayed twice (lowered, then cached), then by the step loop: the same bits
        for loop, extra in calls:
            with tokenring.instrument(step_loop=True) if loop else contextlib.nullcontext():
                runs.append(
                    extend_attention(
                        q_all[:, a:b],
                        k_all[:, rows],
                        v_all[:, rows],
                        new=(a, b),
                        strategy=case["strategy"],
                        softmax_scale=case.get("scale"),
                        window=window,
                        cu_seqlens=cu,
                        positions=mine if (window is not None or cu) else None,
                        sinks=sinks,
                        **extra,
                    )  # fmt: skip
                )
    finally:
        ext.BATCH_ROWS, program.replay_on = old_rows, real
    out = runs[0]
    for got in runs[1:]:
        assert torch.equal(got, out), f"rank {rank}/{P} {case}: extend replayed differs from the step loop"
    if case.get("later") and P > 1:  # (the memo is made at a signature's second such call)
        plain = window is None and not cu and sinks is None and case["strategy"] != "ulysses"
        assert replays[0] >= 1 if plain else replays[0] == 0, f"rank {rank}/{P} {case}: {replays[0]} replays"
    ok = allowed(n + T, True, cu, None if window is None else (window, 0))[n:]
    kk, vv = (x.double().repeat_interleave(H // Hkv, 2) for x in (k_all, v_all))
    s = torch.einsum("bqhd,bkhd->bhqk", q_all.double(), kk) * case.get("scale", d**-0.5)
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:  # one more logit per head in every row's softmax, with no value
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(B, H, T, 1)], dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1)[..., : n + T], vv)
    return rel_err(out, ref[:, a:b]) if b > a else 0.0


def extend_programs(rank: int, P: int, window: bool) -> int:
    """How many extend programs one new kind of call records on this rank (``window``: a masked step)."""
    from tokenring import program
    from tokenring.extend import RowsOps

    def count() -> int:
        return sum(key[0] is RowsOps for key in program._programs)

    before = count()
    case = dict(B=1, n=13 + 2 * P, T=P + 4, H=6, Hkv=3, d=7, dtype="float64", strategy="pass_q", seed=11)
    extend_case(rank, P, dict(case, window=5) if window else case)
    return count() - before


def extend_mismatch(rank: int, P: int, what: str) -> str:
    """One rank passes other shapes (``what``: "heads", or "ranges" that overlap): every rank raises."""
    from tokenring.extend import extend_attention

    H = 8 if (what == "heads" and rank == 0) else 4
    a, b = (0, 2) if (what == "ranges" and rank == 1) else (2 * rank, 2 * rank + 2)
    q, k = torch.randn(1, 2, H, 8), torch.randn(1, 5, 2, 8)
    try:
        extend_attention(q, k, k.clone(), new=(a, b), strategy="pass_q")
    except ValueError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: no ValueError")


def extend_bytes_case(rank: int, P: int, strategy: str) -> tuple[int, int]:
    """Bytes this rank received in one call (Comm's log) and the formula's figure."""
    from tokenring.extend import Shards, extend_attention, extend_bytes, split_new

    B, H, Hkv, d, T = 2, 4 * P, 2 * P, 8, 5 * P + 1
    counts = [30 + (r % 2) for r in range(P)]
    ranges = split_new(counts, T)
    a, b = ranges[rank]
    q = torch.randn(B, b - a, H, d)
    k = torch.randn(B, counts[rank] + b - a, Hkv, d)
    log: list = []
    extend_attention(q, k, k.clone(), new=(a, b), strategy=strategy, log=log)
    sh = Shards(tuple(c + y - x for c, (x, y) in zip(counts, ranges)), tuple(ranges))
    return log[0]["bytes"], extend_bytes(strategy, sh, B, H, Hkv, d, 4, rank)


def extend_silent_case(rank: int, P: int, strategy: str, victim: int, timeout: float):
    """Every rank makes one checked extend call, then rank ``victim`` exits before the next layer's call (no
    shape check there: its messages go first). The others return (seconds to their RuntimeError, message)."""
    import os
    import time

    from tokenring.extend import Shards, extend_attention, split_new

    tokenring.set_timeout(timeout)
    ranges = split_new([6] * P, 2 * P)
    a, b = ranges[rank]
    q, k = torch.randn(1, b - a, 4, 8), torch.randn(1, 6 + b - a, 4, 8)
    shards = Shards(tuple(6 + y - x for x, y in ranges), tuple(ranges))
    extend_attention(q, k, k, new=(a, b), strategy=strategy)
    if rank == victim:
        os._exit(0)
    t0 = time.monotonic()
    try:
        extend_attention(q, k, k, new=(a, b), strategy=strategy, shards=shards, state=None)
    except RuntimeError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError(f"rank {rank}: no RuntimeError although rank {victim} died")


def any_length_case(rank: int, P: int, cases: list[dict]) -> list[float]:
    """Per case: the largest error of out, dq, dk, dv (and dsinks) over this rank's rows of a sequence of any
    length ``S`` sharded by ``tokenring.shard``, against float64 attention over the whole sequence; and the
    gathered output against the reference (``tokenring.gather``)."""
    errs = []
    for case in cases:
        S, H, Hkv, d, causal = case["S"], case["H"], case["Hkv"], case["d"], case["causal"]
        layout, cu, window = case.get("layout"), case.get("cu_seqlens"), case.get("window")
        gen = torch.Generator().manual_seed(S * 7 + P)
        q, dout = (torch.randn(2, S, H, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, S, Hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
        sinks = torch.linspace(-1.0, 1.5, H, dtype=torch.float64) if case.get("sinks") else None
        lay = layout or ("zigzag" if causal else "contiguous")
        docs = cu if lay in (*PLANNED_LAYOUTS, "auto") else None  # the plan follows the documents
        mine = [tokenring.shard(x, 1, lay, cu_seqlens=docs).clone().requires_grad_() for x in (q, k, v)]
        if sinks is not None:
            sinks = sinks.clone().requires_grad_()
        out = tokenring.attention(
            *mine, causal=causal, layout=layout, cu_seqlens=cu, window=window, sinks=sinks, strategy=case["strategy"],
            seq_len=S,
        )  # fmt: skip
        out.backward(tokenring.shard(dout, 1, lay, cu_seqlens=docs))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
        ref = reference(*full, causal, d**-0.5, cu, window, ref_sinks)
        ref.backward(dout)
        got = [out, *(x.grad for x in mine)]
        want = [ref, *(x.grad for x in full)]
        err = max(
            rel_err(g, tokenring.shard(w, 1, lay, cu_seqlens=docs), 1e-3) if g.numel() else 0.0
            for g, w in zip(got, want)
        )
        if sinks is not None:
            got_sinks = sinks.grad.clone()
            if P > 1:  # each rank holds its rows' share of the sinks' gradient (DDP / FSDP sum it)
                torch.distributed.all_reduce(got_sinks)
            err = max(err, rel_err(got_sinks, ref_sinks.grad, 1e-3))
        errs.append(max(err, rel_err(tokenring.gather(out.detach(), 1, lay, cu_seqlens=docs), ref.detach())))
    return errs


@contextlib.contextmanager
def forced_placement(pick: str | None):
    """Inside: ``layout="auto"``'s chooser answers ``pick`` for every batch (to reach each placement on small
    shapes); ``None``: the cost model's own choice."""
    import tokenring.sim.placement as placement

    real = placement.choose_layout
    if pick is not None:
        placement.choose_layout = lambda S, P, bounds: pick
    try:
        yield
    finally:
        placement.choose_layout = real


def auto_layout_case(rank: int, P: int, cases: list[dict]) -> list[tuple[float, str]]:
    """:func:`any_length_case` under ``layout="auto"``; a case's ``pick`` makes the chooser answer that placement
    (:func:`forced_placement`): ``(error, the placement shard chose)`` per case."""
    from tokenring.layouts import resolve_layout

    out = []
    for case in cases:
        c = {k: v for k, v in case.items() if k != "pick"}
        with forced_placement(case.get("pick")):
            chose = resolve_layout("auto", c["S"], P, c.get("cu_seqlens"))
            out.append((any_length_case(rank, P, [dict(c, layout="auto")])[0], chose))
    return out


def settings_on_rank0_case(rank: int, P: int, name: str, value, s: int = 8) -> str:
    """Only rank 0 configures ``name``; the others keep the default. ``"ok"`` when every rank runs the same
    (rank 0 decides ``auto`` for all), else the ValueError this rank raised (the calibration is left out: it is
    rank 0 asking everyone, and takes seconds). ``s``: the local length (a new one is a signature no rank has
    agreed yet)."""
    tokenring.set_timeout(20)
    if rank == 0:
        tokenring.configure(**{name: value})
    try:
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, s, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
        out = tokenring.attention(q, q, q, causal=True)
        out.sum().backward()
        return "ok"
    except ValueError as e:
        return str(e)
    finally:
        tokenring.configure(**{name: None})


def check_calls_case(rank: int, P: int, strategy: str) -> dict:
    """``check_calls`` on every rank: two calls agree a signature, then rank 1 passes K/V of another head dim on
    that signature (a refusal on a cached signature). Returns this rank's message, and whether a forward +
    backward after it equals, bit for bit, the same call before it (the group still usable)."""
    tokenring.set_timeout(20)
    tokenring.configure(check_calls=True)
    try:
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(1, 8, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))

        def call(kk=k, vv=v):
            x, y, z = (t.clone().requires_grad_() for t in (q, kk, vv))
            out = tokenring.attention(x, y, z, causal=True, strategy=strategy)
            out.backward(torch.ones_like(out))
            return [out.detach(), x.grad, y.grad, z.grad]

        before = call()
        call()
        bad = torch.randn(1, 8, 2, 8, dtype=torch.float64)
        try:
            call(*((bad, bad) if rank == 1 else (k, v)))
            msg = None
        except ValueError as e:
            msg = str(e)
        after = call()
        return dict(message=msg, same=all(torch.equal(a, b) for a, b in zip(before, after)))
    finally:
        tokenring.configure(check_calls=None)


def ragged_case(rank: int, P: int, cases: list[dict]) -> list[float]:
    """Per case: non-causal attention over shards of any sizes ``rows`` (rank order; the global sequence is
    their concatenation), forward and backward, against float64 attention over the whole sequence: the largest
    error of out, dq, dk, dv (and the summed dsinks) over this rank's rows."""
    errs = []
    for case in cases:
        rows, H, Hkv, d = case["rows"], case["H"], case["Hkv"], case["d"]
        S, start = sum(rows), sum(rows[:rank])
        gen = torch.Generator().manual_seed(S * 11 + P)
        q, dout = (torch.randn(2, S, H, d, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, S, Hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
        sinks = torch.linspace(-1.0, 1.5, H, dtype=torch.float64) if case.get("sinks") else None
        cut = slice(start, start + rows[rank])
        mine = [x[:, cut].clone().requires_grad_() for x in (q, k, v)]
        if sinks is not None:
            sinks = sinks.clone().requires_grad_()
        out = tokenring.attention(*mine, sinks=sinks, strategy=case["strategy"], rows=rows)
        out.backward(dout[:, cut])
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
        ref = reference(*full, False, d**-0.5, None, None, ref_sinks)
        ref.backward(dout)
        got = [out, *(x.grad for x in mine)]
        want = [ref, *(x.grad for x in full)]
        err = max((rel_err(g, w[:, cut], 1e-3) if g.numel() else 0.0) for g, w in zip(got, want))
        if sinks is not None:
            got_sinks = sinks.grad.clone()
            if P > 1:
                torch.distributed.all_reduce(got_sinks)
            err = max(err, rel_err(got_sinks, ref_sinks.grad, 1e-3))
        errs.append(err)
    return errs


def ragged_refused(rank: int, P: int) -> dict:
    """rows= misuse, every rank's ValueError message: ``mismatch`` (rank 1's q holds other rows than rows says),
    ``causal`` (rows with causal attention), ``differ`` (the last rank passes other rows, its own count right)."""
    out = {}
    q = torch.randn(1, 3, 2, 4)
    other = [*range(P - 1), 3]
    for name, rows, causal, mine in (
        ("mismatch", [3] * P, False, q[:, :2] if rank == 1 else q),
        ("causal", [3] * P, True, q),
        ("differ", other if rank == P - 1 else [3] * P, False, q),
    ):
        try:
            tokenring.attention(mine, mine, mine, rows=rows, causal=causal)
            out[name] = "not refused"
        except ValueError as e:
            out[name] = str(e)
    return out


def repeated_calls_case(rank: int, P: int, strategy: str = "auto") -> dict:
    """The same call shapes again and again, changing what the prepared path (ops.Ready) must notice between
    repeats: values, requires_grad, no_grad, check_calls, forget_choices, documents as a list, a window, an
    instrumented call, documents as one tensor (then edited in place), a checkpointed first call (its recompute
    prepared: the same tensors saved). Returns the worst error against float64, how many calls took the
    prepared path and how many forwards and backwards of those replayed their program straight from the
    prepared call (``Ready.memo``: from a prepared call's third run on)."""
    from tokenring import api, ops

    taken, replayed = [0], [0]
    real, real_replay = api.ready_again, ops._replay

    def counted(key, anchor=None):
        hit = real(key, anchor)
        taken[0] += hit is not None
        return hit

    def counted_replay(memo, what, group):
        hit = real_replay(memo, what, group)
        replayed[0] += hit is not None
        return hit

    api.ready_again, ops._replay = counted, counted_replay
    worst = 0.0
    S, H, Hkv, d = 12 * P, 4, 2, 8
    idx = local_positions(S, P, rank, "zigzag")
    docs_t = torch.tensor([0, 5, S])  # documents as one tensor, as a model's layers share it
    try:
        for i, (grad, docs, window, mode) in enumerate(
            [(True, None, None, ""), (True, None, None, ""), (True, None, None, ""), (False, None, None, ""),
             (False, None, None, ""), (False, None, None, ""),
             (True, None, None, "check_calls"), (True, None, None, "forget"), (True, None, None, ""),
             (True, [0, 5, S], None, ""), (True, [0, 5, S], None, ""), (True, [0, 7, S], None, ""),
             (True, None, (3, 0), ""), (True, None, (3, 0), ""), (True, None, None, "instrument"),
             (True, docs_t, None, ""), (True, docs_t, None, ""), (True, docs_t, None, "edit"),
             (True, [0, 9, S], (5, 0), "checkpoint")]
        ):  # fmt: skip
            g = torch.Generator().manual_seed(i)
            full = [torch.randn(1, S, h, d, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]
            q, k, v = (t.index_select(1, idx).clone().requires_grad_(grad) for t in full[:3])
            if mode == "forget":
                tokenring.forget_choices()
            if mode == "edit":  # the same tensor, edited in place: other documents
                docs_t[1] = 7
            log: list = []
            with contextlib.ExitStack() as stack:
                if mode == "check_calls":
                    tokenring.configure(check_calls=True)
                    stack.callback(tokenring.configure, check_calls=False)
                if mode == "instrument":
                    stack.enter_context(tokenring.instrument(comm_log=log))
                if mode == "checkpoint":  # a first call, recomputed in backward on the prepared path
                    out = torch.utils.checkpoint.checkpoint(
                        lambda *x: tokenring.attention(*x, causal=True, cu_seqlens=docs, window=window,
                                                       strategy=strategy), q, k, v,
                        use_reentrant=False,
                    )  # fmt: skip
                else:
                    out = tokenring.attention(q, k, v, causal=True, cu_seqlens=docs, window=window, strategy=strategy)
                if grad:
                    out.backward(full[3].index_select(1, idx))
            if mode == "instrument":
                assert log and all(records for _, records in log), log  # the byte records are kept when read
            want = [t.detach().clone().requires_grad_() for t in full[:3]]
            ref = reference(*want, True, d**-0.5, None if docs is None else [int(x) for x in docs], window)
            ref.backward(full[3])
            worst = max(worst, float((out.detach() - ref.detach().index_select(1, idx)).abs().max()))
            if grad:
                for mine, w in zip((q, k, v), want):
                    worst = max(worst, float((mine.grad - w.grad.index_select(1, idx)).abs().max()))
    finally:
        api.ready_again, ops._replay = real, real_replay
    return {"worst": worst, "taken": taken[0], "replayed": replayed[0]}


def replay_case(rank: int, P: int, todo: list[dict]) -> int:
    """Each case's forward and backward replayed from its recorded program (twice: lowered, then cached) and
    run by the step loop (``instrument(step_loop=True)``): out and every gradient must be the same bits."""
    for case in todo:
        (*full, dout_full), idx = case_inputs(rank, P, case)
        sinks = sink_logits(case)
        results = []
        for loop in (False, False, True):
            local = [t.index_select(1, idx).clone().requires_grad_() for t in full]
            sk = sinks.clone().requires_grad_() if sinks is not None else None
            with tokenring.instrument(step_loop=loop):
                out = tokenring.attention(
                    *local, causal=case["causal"], strategy=case["strategy"], layout=case["layout"],
                    cu_seqlens=case.get("cu_seqlens"), window=case.get("window"), sinks=sk,
                    inner_size=case.get("inner_size"),
                )  # fmt: skip
            out.backward(dout_full.index_select(1, idx))
            results.append([out, *(t.grad for t in local), *([sk.grad] if sk is not None else [])])
        for got in results[:2]:
            for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, results[2]):
                assert torch.equal(a, b), f"rank {rank}/{P} {case}: {name} replayed differs from the step loop"
    return len(todo)


def refused_then_good(rank: int, P: int, kind: str) -> tuple[str, float]:
    """Rank 1 alone passes arguments its own checks refuse (``kind``: "decode": heads that do not divide; "extend":
    a new-token range longer than its queries), then every rank makes a good call of the same kind: (the
    ValueError this rank got, the good call's error against the float64 reference)."""
    from tokenring.decode import decode_attention
    from tokenring.extend import extend_attention

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 6, 2 if rank != 1 or kind != "decode" else 3, 8)
    try:
        if kind == "decode":
            decode_attention(q[:, :1], k, k.clone(), state=(6 * P,))
        else:
            extend_attention(q, k, k.clone(), new=(2 * rank, 2 * rank + (3 if rank == 1 else 2)), strategy="pass_q")
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError(f"rank {rank}: no ValueError")
    if kind == "decode":
        case = dict(B=2, n=5 * P + 2, t=1, H=6, Hkv=2, d=12, dtype="float64", seed=1)
        return msg, decode_case(rank, P, case)[1]
    case = dict(B=1, n=4 * P + 1, T=2 * P + 1, H=4, Hkv=2, d=8, dtype="float64", strategy="pass_q", seed=2)
    return msg, extend_case(rank, P, case)
