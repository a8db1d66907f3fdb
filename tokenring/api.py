"""Public entry point: ``tokenring.attention`` — validation and dispatch to a strategy."""
from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import get_timeout, group_store
from .kernels import fold_scale, softmax_scale_of, tiled_backward, tiled_forward
from .layouts import LAYOUTS, check_layout, default_layout, document_bounds, group_info
from .masks import make_mask, whole_tiles
from .schedules import Shapes
from .strategies import (ALIASES, CODE_LEN, FAMILIES, code as strategy_code, from_code, get as get_strategy,
                         node_size, with_node_size)
from .strategies.base import Config, ScheduledAttention

__all__ = ["attention", "choose_strategy", "resolve", "STRATEGY_NAMES", "forget_choices"]

STRATEGY_NAMES = FAMILIES + tuple(ALIASES) + ("auto",)
# (group, signature) -> the strategy that runs: signatures already verified identical on every rank, with the
# choice rank 0 made for "auto" / a family choice (set_topology clears it on every rank: calls re-decide).
_checked: dict = {}
_exchanges: dict = {}  # per group: signature exchanges so far (the same count on every rank in step)


def forget_choices() -> None:
    """Drop the verified signatures and the cached ``auto`` choices (``set_topology`` calls this)."""
    _checked.clear()


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
    where = f"rank {rank}: "
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{where}{name} has shape {tuple(t.shape)}; expected 4 dims (batch, seq_local, heads, "
                             f"head_dim), the flash-attn layout")
    if k.shape != v.shape:
        raise ValueError(f"{where}k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, s, H, d = q.shape
    for what, i, name in (("batch", 0, "batch size"), ("seq_local", 1, "local sequence length"),
                          ("head_dim", 3, "head dim")):
        if k.shape[i] != q.shape[i]:
            raise ValueError(f"{where}q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in {name} (dim {i}, "
                             f"{what}); q and k/v must be shards of the same tokens")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{where}q has {H} heads and k/v {Hkv}: the query heads must be a multiple of the "
                         f"key/value heads (MHA: equal, GQA: H % Hkv == 0, MQA: Hkv == 1)")
    if 0 in q.shape:
        raise ValueError(f"{where}q has shape {tuple(q.shape)}: batch, local length, heads and head dim must be "
                         f"positive")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not q.is_floating_point():
        raise ValueError(f"{where}q has dtype {q.dtype}; attention needs floating point inputs")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}q, k, v are on different devices ({q.device}, {k.device}, {v.device}); "
                         f"move them to one device")


def choose_strategy(H: int, Hkv: int, P: int, *, B: int = 1, s: int | None = None, d: int = 128,
                    dtype: torch.dtype = torch.bfloat16, causal: bool = False, layout: str | None = None,
                    backward: bool = True, device_type: str = "cpu", topology=None, requested: str = "auto",
                    mask=None, inner_size: int | None = None) -> str:
    """What ``strategy=requested`` (``"auto"``, or a family choice such as ``"token_ring"``) runs for this
    rank's shard shapes on ``P`` ranks: a concrete variant's spec.

    With the local length ``s`` given, the cost model (``tokenring.sim``) simulates every candidate's schedule
    on the group's topology (``tokenring.set_topology``, ``$TOKENRING_TOPOLOGY``, else ``loopback`` on CPU /
    ``h100-nvswitch-8`` on CUDA) and picks the fastest; ``tokenring.explain`` shows the numbers. Ulysses is
    a candidate only when ``H % P == 0``. Without ``s``, the shape-free rule: TokenRing for MHA, pass-KV
    ring for GQA/MQA (K+V is smaller than Q there). ``mask``: a :class:`tokenring.masks.Mask` (packed
    documents, window) the candidates' schedules are cut for. ``inner_size``: ranks per node (default
    ``$LOCAL_WORLD_SIZE``), for the hierarchical strategies."""
    n = node_size(inner_size)
    requested = requested if requested == "auto" else with_node_size(get_strategy(requested), n).name
    if s is None or P < 2:
        if requested != "auto":
            return get_strategy(requested).variants(P)[0].name
        return "token_ring:relay" if H == Hkv else "ring"
    from .sim.auto import choose
    layout = layout or default_layout(causal)
    return choose(Shapes(B, s, H, Hkv, d, dtype, P), causal, layout, backward, device_type, topology, requested,
                  mask, n)[0]


def resolve(strategy: str, q_shape, k_shape, P: int, *, dtype=torch.bfloat16, causal: bool = False,
            layout: str | None = None, backward: bool = True, device_type: str = "cpu", mask=None,
            inner_size: int | None = None):
    """The concrete strategy ``tokenring.attention(strategy=...)`` runs for these shard shapes on ``P`` ranks
    (from this process's topology setting; inside ``attention`` rank 0 decides for everyone)."""
    if strategy != "auto":
        st = with_node_size(get_strategy(strategy), node_size(inner_size))
        if st.mode != "auto":
            return st
    B, s, H, d = q_shape
    return get_strategy(choose_strategy(H, k_shape[2], P, B=B, s=s, d=d, dtype=dtype, causal=causal,
                                        layout=layout, backward=backward, device_type=device_type,
                                        requested=strategy, mask=mask, inner_size=inner_size))


def _code(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes, unlike hash()


def _signature(q, k, causal, layout, strategy, scale, backward, mask_code: int, inner: int) -> list[float]:
    B, s, H, d = q.shape
    return [0.0, B, s, H, k.shape[2], d, _code(str(q.dtype)), _code(q.device.type),
            float(causal), LAYOUTS.index(layout), _code(strategy), scale, float(backward), float(mask_code),
            float(inner)]


_FIELDS = ["refused", "batch", "local length", "query heads", "key/value heads", "head dim", "dtype", "device type",
           "causal", "layout", "strategy", "softmax_scale", "backward (inputs requiring grad)",
           "cu_seqlens / window (checksum)", "inner_size (ranks per node)"]
# What a rank that refuses its own arguments sends: the flag, and nothing the others could compare.
_REFUSED = [1.0] + [0.0] * (len(_FIELDS) - 1)


def _show(field: str, value: float) -> str:
    if field == "strategy":
        return next((repr(n) for n in STRATEGY_NAMES if _code(n) == value), f"a spec with code {int(value)}")
    return f"{value:g}" if field in ("softmax_scale",) else str(int(value))


def _agree(sig: list[float], decide, describe: str, group, device, rank: int, P: int, remember: bool = True):
    """Verify that every rank calls with the same shapes and options, and return the strategy to run.

    ``decide()`` resolves the strategy; only rank 0 calls it (``auto`` runs the cost model there) and its
    answer travels with the signature exchange, so no per-host input (cores, threads, a topology set on one
    rank only) can make the ranks disagree. Done once per (group, signature); later calls reuse the result.
    ``remember=False`` (a rank that will refuse its arguments): exchange every time, never skip. ``decide``
    ``None``: this rank refuses its arguments (``sig`` is ``_REFUSED``)."""
    key = (id(group), tuple(sig))  # nothing per-host in it: a rank that re-checked alone would wait for the others
    if remember and key in _checked:
        return _checked[key]
    choice = strategy_code(decide()) if rank == 0 and decide is not None else [-1.0] * CODE_LEN
    mine = torch.tensor(sig + choice, dtype=torch.float64, device=device)
    allsig = [torch.empty_like(mine) for _ in range(P)]
    # Each rank marks its arrival in the rendezvous store, so a rank that never comes can be named.
    n = _exchanges[id(group)] = _exchanges.get(id(group), -1) + 1
    store, prefix = group_store(group), f"tokenring/arrived/{n}/"
    try:
        store.set(prefix + str(rank), "1")
    except Exception:
        store = None
    work = dist.all_gather(allsig, mine, group=group, async_op=True)
    try:
        work.wait(datetime.timedelta(seconds=get_timeout()))
    except Exception as e:
        missing = ""
        try:
            gone = [r for r in range(P) if not store.check([prefix + str(r)])]
            missing = f" Rank(s) {gone} never reached this call: they died or do not call attention here." \
                if gone else ""
        except Exception:
            pass
        raise RuntimeError(
            f"tokenring: rank {rank} could not compare call signatures with the other ranks within "
            f"{get_timeout():.0f} s ({e}).{missing} A rank has died, or is not calling tokenring.attention at this "
            f"point (every rank of the group must call it with the same shapes and options). The process group "
            f"cannot be used again after this: destroy it and start the ranks again.") from e
    refused = [r for r, other in enumerate(allsig) if other[0].item()]
    if refused:  # a refusing rank raises its own error; the others say who refused, at the same moment
        raise ValueError(f"tokenring: rank(s) {refused} refused their arguments to attention (each raised an error "
                         f"saying why); here: {describe}")
    for r, other in enumerate(allsig):
        bad = [f"{f} ({_show(f, a)} on rank {r}, {_show(f, b)} on rank {rank})"
               for f, a, b in zip(_FIELDS, other.tolist(), sig) if a != b]
        if bad:
            raise ValueError(
                f"tokenring: rank {r} calls attention with a different {'; '.join(bad)}; here: {describe}. "
                f"Every rank must pass shards of the same shape, dtype and options; shard the sequence with "
                f"tokenring.shard() so local lengths are equal.")
    chosen = from_code(allsig[0][-CODE_LEN:].tolist())
    if remember:
        _checked[key] = chosen
    return chosen


class _MaskedSingle(torch.autograd.Function):
    """One rank, documents / window: the tiles of the whole sequence (no (S, S) mask is ever built)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.tiles = whole_tiles(mask, q.device)  # (tiles, mask_of), for backward too
        o, lse = tiled_forward(q, k, v, *ctx.tiles, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, dout):
        from .strategies.base import row_delta
        q, k, v, o, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = tiled_backward(dout, q, k, v, lse, row_delta(dout, o), *ctx.tiles, ctx.scale, out=o)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _single_device(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, strategy: str = "auto", layout: str | None = None,
              cu_seqlens=None, window: tuple[int, int] | None = None,
              group=None, inner_size: int | None = None, _config: dict | None = None) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    ``q``: (B, s, H, d), ``k``/``v``: (B, s, Hkv, d), this rank's shard (laid out by ``layout``; default
    ``"zigzag"`` when causal, else ``"contiguous"``, and it must match how the caller sharded). Returns
    (B, s, H, d) in ``q.dtype``: the same rows of single-device attention over the whole sequence.
    Differentiable in ``q``, ``k``, ``v``. ``strategy``: ``"token_ring"`` (the TokenRing variant the cost
    model predicts fastest), ``"token_ring_paper"`` (= ``"token_ring:relay"``), an explicit variant such as
    ``"token_ring:direct,c=2,k=3"`` or ``"ring:direct,c=1,k=3"``, ``"ring"``, ``"ring:auto"``,
    ``"ring_bidir"``, ``"ulysses"`` or ``"auto"`` (every strategy and variant). Choices are made on rank 0 and
    shared. With no process group initialised (or one rank) plain attention runs.

    Packed sequences and sliding windows (flash-attn's conventions, over the *global* sequence of
    ``S = s * P`` tokens, whatever the layout): ``cu_seqlens`` ``[0, end_1, ..., S]`` (1-D ints, the same on
    every rank) puts documents one after another, a query seeing keys of its own document only (for every
    row of the batch); ``window=(left, right)`` lets query ``i`` see keys ``i-left .. i+right`` (``-1``:
    unbounded; ``causal`` caps ``right`` at 0). Every strategy takes both; blocks no query sees are neither
    computed nor sent (Ulysses skips the computation only: its all-to-alls move every row).
    ``layout="zigzag_docs"`` (with ``cu_seqlens``, every document a multiple of ``2P`` tokens; shard with
    ``tokenring.shard(x, layout="zigzag_docs", cu_seqlens=cu)``) zigzags each document over the ranks, which
    balances causal work whatever the document lengths.

    Beyond one node: ``"usp"`` (Ulysses inside a node, ring between nodes), ``"double_ring"`` and
    ``"token_ring_2d"`` (ring / TokenRing inside a node, K/V ring between nodes) run over nodes of
    ``inner_size`` ranks (default ``$LOCAL_WORLD_SIZE``, which torchrun sets): ranks ``a*n .. a*n+n-1`` of
    the group form node ``a``. With a node size known (or a multi-node topology set), ``"auto"`` considers
    them too.
    """
    rank, P = group_info(group)
    layout = layout if layout is not None else default_layout(causal)
    problem, mask = None, None
    # Arguments this rank refuses still go through the signature exchange below, so every rank raises at once
    # instead of the others waiting for it until the timeout.
    try:
        _check_local(q, k, v, rank)
        n = node_size(inner_size)
        if strategy != "auto":  # unknown names fail here, before any communication
            strategy = with_node_size(get_strategy(strategy), n).name
        check_layout(layout)
        B, s, H, d = q.shape
        Hkv = k.shape[2]
        scale = softmax_scale_of(softmax_scale, d)
        if layout == "zigzag_docs":
            document_bounds(s * P, P, cu_seqlens)  # every document must split over the ranks
        mask = make_mask(s * P, cu_seqlens, window, causal, force=layout == "zigzag_docs")
        if P > 1 and layout == "zigzag" and s % 2:
            raise ValueError(f"layout='zigzag' needs an even local length (two chunks per rank), got {s}; pad the "
                             f"global sequence to a multiple of 2*P = {2 * P}")
        if P > 1 and strategy != "auto":
            why = get_strategy(strategy).check(H, Hkv, P, s, causal and layout == "zigzag")
            if why:
                raise ValueError(why)
    except ValueError as e:
        problem = e if str(e).startswith(f"rank {rank}:") else ValueError(f"rank {rank}: {e}")
    if P == 1:
        if problem is not None:
            raise problem from None
        q, scale = fold_scale(q, scale)
        if mask is not None:
            return _MaskedSingle.apply(q, k, v, mask, scale)
        return _single_device(q, k, v, causal, scale)
    if problem is not None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        try:
            _agree(list(_REFUSED), None, "", group, device, rank, P, remember=False)
        except (ValueError, RuntimeError):  # its own error is the one to raise
            pass
        raise problem from None
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

    def decide():  # a concrete variant; for "auto" / a family choice the cost model, run on rank 0 only
        return resolve(strategy, q.shape, k.shape, P, dtype=q.dtype, causal=causal, layout=layout,
                       backward=backward, device_type=q.device.type, mask=mask, inner_size=n or None)

    describe = f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}, causal={causal}, layout={layout}, " \
               f"strategy={strategy!r}" + (f", {mask.describe()}" if mask is not None else "")
    strat = _agree(_signature(q, k, causal, layout, strategy, scale, backward, mask.key if mask is not None else 0, n),
                   decide, describe, group, q.device if dist.get_backend(group) == "nccl" else "cpu", rank, P)
    q, scale = fold_scale(q, scale)
    cfg = Config(group=group, rank=rank, P=P, causal=causal, layout=layout, scale=scale, mask=mask,
                 **(_config or {}))
    q, k, v = strat.prepare(q, k, v, P)
    return ScheduledAttention.apply(q, k, v, strat, cfg)
