"""``tokenring.attention``: the public call. It checks this rank's arguments and runs the
``tokenring::attention_fwd`` op (:mod:`tokenring.ops`); one rank without a mask runs PyTorch's own attention.
"""

from __future__ import annotations

import torch

from .choice import choose_strategy, resolve
from .device import device_type as device_kind
from .instrument import current as current_instruments
from .kernels import attention_inputs, fold_scale
from .layouts import group_info
from .masks import check_bounds_tensor
from .ops import (
    Call,
    _check_local,
    _check_sinks,
    _frozen,
    _group_name,
    _ranked,
    _refuse_everywhere,
    _single_device,
    attention_op,
    forget_choices,
    plan,
    register_extras,
)
from .strategies import NAMES

__all__ = ["attention", "choose_strategy", "resolve", "STRATEGY_NAMES", "forget_choices"]

STRATEGY_NAMES = NAMES


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    strategy: str = "auto",
    layout: str | None = None,
    cu_seqlens=None,
    window: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
    group=None,
    inner_size: int | None = None,
) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    ``q``: (B, s, H, d), ``k``: (B, s, Hkv, d), ``v``: (B, s, Hkv, dv), this rank's shard (laid out by
    ``layout``; default ``"zigzag"`` when causal, else ``"contiguous"``, and it must match how the caller
    sharded); ``dv`` may differ from ``d`` (MLA; zero columns fill the gap, so the shorter side's bytes grow).
    Returns (B, s, H, dv) in ``q.dtype``: the same rows of single-device attention over the whole sequence.
    Differentiable in ``q``, ``k``, ``v`` (and ``sinks``). ``strategy``: ``"token_ring"`` (the TokenRing
    variant the cost model predicts fastest), ``"token_ring_paper"`` (= ``"token_ring:relay"``), an explicit
    variant such as ``"token_ring:direct,c=2,k=3"`` or ``"ring:direct,c=1,k=3"``, ``"ring"``, ``"ring:auto"``,
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

    ``sinks``: gpt-oss style attention sinks, a (H,) tensor of logits (one per query head, not scaled by
    ``softmax_scale``) added to every row's softmax denominator: the output of a row is
    ``sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``. The sink is one more partial in the merge; its
    gradient on each rank is that rank's rows' share (sum it over the ranks like any replicated weight's).

    Under ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``scaled_dot_product_attention``
    does. Under ``torch.compile`` the call is one custom op (``tokenring::attention_fwd``, no graph break);
    ``"auto"`` and family choices are then made when the graph is traced, from this rank's cost model unless an
    eager call with the same shapes already agreed on one (ranks that traced different choices are refused
    at run time).

    Beyond one node: ``"usp"`` (Ulysses inside a node, ring between nodes), ``"double_ring"`` and
    ``"token_ring_2d"`` (ring / TokenRing inside a node, K/V ring between nodes) run over nodes of
    ``inner_size`` ranks (default ``$LOCAL_WORLD_SIZE``, which torchrun sets): ranks ``a*n .. a*n+n-1`` of
    the group form node ``a``. With a node size known (or a multi-node topology set), ``"auto"`` considers
    them too.
    """
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: the value head dim differs from q/k's; run with zero columns, keep dv of them
        return attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, strategy=strategy, layout=layout,
            cu_seqlens=cu_seqlens, window=window, sinks=sinks, group=group, inner_size=inner_size,
        )[..., :dv]  # fmt: skip
    compiling = torch.compiler.is_compiling()
    rank, P = group_info(group)
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) or cu_seqlens is None else None
    try:
        _check_local(q, k, v, rank)
        _check_sinks(sinks, q, rank)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None)
        if cu is not None:
            check_bounds_tensor(cu)
        call = plan(
            tuple(q.shape),
            tuple(k.shape),
            q.dtype,
            device_kind(q),
            strategy,
            causal,
            softmax_scale,
            layout,
            None if cu_seqlens is None or cu is not None else _frozen(cu_seqlens),
            cu is not None,
            _frozen(window),
            sinks is not None,
            _group_name(group),
            inner_size,
            backward,
            compiling,
        )
    except ValueError as e:
        if P == 1 or compiling:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    strategy, scale, layout, window, n, cu_list, plain = call
    if cu_list is not None:
        cu = torch.tensor(cu_list, dtype=torch.int64)
    if plain:  # one rank, nothing to mask: PyTorch's own attention
        q, scale = fold_scale(q, scale)
        return _single_device(q, k, v, causal, scale)
    hooks = current_instruments()
    if hooks is not None and compiling:
        raise ValueError("tokenring.attention: tokenring.instrument() (tracing, byte logs) works in eager mode only")
    extras_id, holder = register_extras(hooks)
    call = Call(strategy, causal, scale, layout, window, _group_name(group), n, backward, extras_id)
    out = attention_op(q, k, v, sinks, cu, call)
    del holder  # the op's autograd context keeps it while backward may still run
    return out
