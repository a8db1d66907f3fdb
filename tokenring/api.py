"""``tokenring.attention``: the public call. It checks this rank's arguments and runs the
``tokenring::attention_fwd`` op (:mod:`tokenring.ops`); one rank without a mask runs PyTorch's own attention.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .agreement import code
from .choice import choose_strategy, resolve
from .comm import move_rows
from .device import device_type as device_kind
from .instrument import current as current_instruments
from .kernels import attention_inputs, fold_scale
from .layouts import (
    AUTO_LAYOUT,
    LAYOUTS,
    PLANNED_LAYOUTS,
    auto_inputs,
    default_layout,
    even_out,
    group_info,
    padded_length,
    resolve_layout,
    shard_positions,
)
from .masks import check_bounds_tensor, whole_numbers
from .ops import (
    Call,
    _agree,
    _check_local,
    _check_sinks,
    _frozen,
    _group_name,
    _plain_eager,
    _ranked,
    _refuse_everywhere,
    _signature_of,
    _single_device,
    attention_op,
    eager_ready,
    forget_choices,
    plan,
    prepare_forward,
    ready_again,
    register_extras,
    remember_ready,
)
from .strategies import NAMES
from .strategies import get as get_strategy

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
    seq_len: int | None = None,
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    ``q`` (B, s, H, d), ``k`` (B, s, Hkv, d), ``v`` (B, s, Hkv, dv): this rank's shard, laid out by ``layout``
    (default ``"zigzag"`` when causal, else ``"contiguous"``: as the caller sharded; ``"auto"``: the placement
    the cost model picks for ``cu_seqlens``, as :func:`tokenring.shard` picks it). Returns (B, s, H, dv) in
    ``q.dtype``, the rows of single-device attention over the whole sequence; differentiable in q, k, v, sinks.
    ``strategy``: ``"auto"`` (the cost model's pick, made on rank 0 and shared), a family (``"token_ring"``,
    ``"ring"``, ``"ring_bidir"``, ``"ulysses"``; over nodes of ``inner_size`` ranks ``"usp"``, ``"double_ring"``,
    ``"token_ring_2d"``) or a variant (``"token_ring:direct,c=2,k=3"``). ``cu_seqlens`` ``[0, ..., S]`` packs
    documents and ``window=(left, right)`` bounds what a query sees, over the global sequence (flash-attn's
    conventions); ``sinks``: (H,) gpt-oss sink logits. Runs under ``torch.autocast`` and ``torch.compile``.
    Any length: ``seq_len`` names the global length when the shards are uneven, as :func:`tokenring.shard` cuts
    a sequence of any length (``cu_seqlens`` then ends at it). Any rows per rank (zero too) when not causal
    and without documents or a window, where rows have no order (joint streams each split on its own): ``rows``
    gives every rank's row count, in rank order, the same on every rank. Every rank calls with the same options;
    what is refused is a ValueError on every rank. The full reference: docs/internals.md, "attention()".
    """
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: the value head dim differs from q/k's; run with zero columns, keep dv of them
        return attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, strategy=strategy, layout=layout,
            cu_seqlens=cu_seqlens, window=window, sinks=sinks, group=group, inner_size=inner_size, seq_len=seq_len,
            rows=rows,
        )[..., :dv]  # fmt: skip
    rank, P = group_info(group)
    key = _call_key(q, k, v, sinks, causal, softmax_scale, strategy, layout, cu_seqlens, window, group, inner_size,
                    seq_len, rows)  # fmt: skip
    if key is not None:  # this exact call ran before and its agreement stands: straight to the strategy
        ready = ready_again(key, cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None)
        # (a group made anew under the same name may have another size)
        if ready is not None and (ready.cfg.rank, ready.cfg.P) == (rank, P) and current_instruments() is None:
            if _plain_eager(q, k, v, sinks):
                return eager_ready(ready, q, k, v, sinks, None)
    if rows is not None:
        return _ragged(q, k, v, rows, causal, softmax_scale, strategy, cu_seqlens, window, sinks, group, inner_size,
                       seq_len, rank, P)  # fmt: skip
    if layout == AUTO_LAYOUT:  # this batch's placement: a pure function of its documents, alike on every rank
        try:
            S = int(seq_len) if seq_len is not None else q.shape[1] * P
            layout = resolve_layout(layout, S, P, cu_seqlens, need_documents=True)
        except (TypeError, ValueError) as e:
            if P == 1 or torch.compiler.is_compiling():
                raise _ranked(ValueError(f"tokenring.attention: {e}"), rank) from None
            _refuse_everywhere(_ranked(ValueError(f"tokenring.attention: {e}"), rank), group, rank, P)
    S = _uneven_length(q, seq_len, layout, causal, P)
    if S is not None:  # shards of a length the layout does not split evenly: pad them, run, cut the padding
        return _uneven(q, k, v, S, causal, softmax_scale, strategy, layout, cu_seqlens, window, sinks, group,
                       inner_size, rank, P)  # fmt: skip
    compiling = torch.compiler.is_compiling()
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) or cu_seqlens is None else None
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None)
    try:
        call = _checked_plan(q, k, v, sinks, cu, cu_seqlens, strategy, causal, softmax_scale, layout, window, group,
                             inner_size, backward, compiling, rank)  # fmt: skip
    except ValueError as e:
        if P == 1 or compiling:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    strategy, scale, layout, window, n, cu_list, plain, shortest, refused = call
    if shortest and q.shape[1] < shortest:  # a guard, never taken when traced: a shorter length traces anew
        raise AssertionError(f"tokenring: {strategy!r} was traced for local lengths of at least {shortest}")
    if cu_list is not None and not refused:
        cu = torch.tensor(cu_list, dtype=torch.int64)
    if plain:  # one rank, nothing to mask: PyTorch's own attention
        q, scale = fold_scale(q, scale)
        return _single_device(q, k, v, causal, scale)
    recheck = compiling and not _static(q.shape[1])
    return _run_op(q, k, v, sinks, cu, strategy, causal, scale, layout, window, group, n, backward, compiling,
                   recheck, refused, key)  # fmt: skip


def _run_op(q, k, v, sinks, cu, strategy, causal, scale, layout, window, group, n, backward, compiling: bool,
            recheck: bool = False, refused: str = "", key=None):  # fmt: skip
    """The ``tokenring::attention_fwd`` op for a planned call, with this call's instruments (eager only); a plain
    eager call without instruments is remembered under ``key`` for its repeats."""
    hooks = current_instruments()
    if hooks is not None and compiling:
        raise ValueError("tokenring.attention: tokenring.instrument() (tracing, byte logs) works in eager mode only")
    extras_id, holder = register_extras(hooks)
    call = Call(strategy, causal, scale, layout, window, _group_name(group), n, backward, extras_id, recheck, refused)
    if key is not None and hooks is None and not compiling and not recheck and _plain_eager(q, k, v, sinks, cu):
        ready = prepare_forward(q, k, sinks, cu, call)
        out = eager_ready(ready, q, k, v, sinks, None)  # (as its repeats: the same tensors saved for backward,
        remember_ready(key, ready, cu if key[-1] == "documents tensor" else None)  # which checkpointing compares)
        return out
    out = attention_op(q, k, v, sinks, cu, call)
    del holder  # the op's autograd context keeps it while backward may still run
    return out


def _call_key(q, k, v, sinks, causal, softmax_scale, strategy, layout, cu_seqlens, window, group, inner_size,
              seq_len, rows) -> tuple | None:  # fmt: skip
    """What decides an eager call's plan, as a key (``None``: a call that is not looked up: rows, tracing): the
    arguments' shapes, dtypes, devices and options, and whether it records a backward. Documents as a tensor
    (a model's layers share one) by its identity and version, the key then ending in ``"documents tensor"``
    (the lookup also checks that very tensor: :func:`tokenring.ops.ready_again`)."""
    if rows is not None or torch.compiler.is_compiling():
        return None
    try:
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.is_inference() or type(cu_seqlens) is not torch.Tensor:
                return None  # (no version counter, or a subclass)
            docs, kind = (id(cu_seqlens), cu_seqlens._version), "documents tensor"
        else:
            docs, kind = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens), "documents"
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
        return (  # the group's name, not its id: a group made after another was destroyed may reuse the id
            _group_name(group), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            None if sinks is None else (sinks.shape, sinks.dtype, sinks.device), causal, softmax_scale, strategy,
            layout, docs, None if window is None else tuple(window), inner_size, seq_len,
            auto_inputs() if layout == AUTO_LAYOUT else None, grad, kind,
        )  # fmt: skip
    except (TypeError, AttributeError, ValueError):  # not tensors, or options that are not plain values: no key
        return None


def _uneven_length(q, seq_len, layout, causal: bool, P: int) -> int | None:
    """The global length when this call's shards are not the layout's even split of ``s * P`` (else ``None``)."""
    if seq_len is None:  # (documents ending elsewhere than s * P are a mistake the plan names, not a length)
        return None
    S, layout = int(seq_len), layout or default_layout(causal)
    if S == q.shape[1] * P and (P == 1 or layout not in LAYOUTS or S == padded_length(S, P, layout)):
        return None  # even, one rank (or a layout the plan refuses by name)
    return S


def _uneven(q, k, v, S: int, causal, softmax_scale, strategy, layout, cu_seqlens, window, sinks, group, inner_size,
            rank: int, P: int) -> torch.Tensor:  # fmt: skip
    """Attention over shards of a sequence of any length ``S``: each rank's rows padded at the end of the global
    sequence to :func:`padded_length`, the padding in a document of its own (none needed when causal without
    a window or documents: every real row precedes it), then cut off. Pad rows are zeros: no gradient reaches
    the real rows through them."""
    layout = layout or default_layout(causal)
    try:
        mine = _uneven_rows(q, k, v, S, layout, cu_seqlens, rank, P)
    except ValueError as e:
        if P == 1:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    Sp = padded_length(S, P, layout)
    cu = cu_seqlens
    if cu is not None:  # the padding, one more document
        cu = torch.cat([cu, cu.new_tensor([Sp])]) if isinstance(cu, torch.Tensor) else [*map(int, cu), Sp]
    elif not causal or window is not None:
        cu = [0, S, Sp]

    def pad(x):
        return torch.cat([x, x.new_zeros(x.shape[0], Sp // P - mine, *x.shape[2:])], 1)

    out = attention(
        pad(q), pad(k), pad(v), causal=causal, softmax_scale=softmax_scale, strategy=strategy, layout=layout,
        cu_seqlens=cu, window=window, sinks=sinks, group=group, inner_size=inner_size,
    )  # fmt: skip
    return out[:, :mine]


def _ragged(q, k, v, rows, causal, softmax_scale, strategy, cu_seqlens, window, sinks, group, inner_size, seq_len,
            rank: int, P: int) -> torch.Tensor:  # fmt: skip
    """Attention over shards of any sizes ``rows`` where rows have no order: the ranks agree on the call, even
    the shards out to the contiguous split of their total (:func:`even_out`: only rows over a rank's share
    move), run that, and send the output rows back where their queries came from."""
    try:
        rows = _ragged_rows(q, k, v, rows, causal, cu_seqlens, window, seq_len, rank, P)
    except ValueError as e:
        if P == 1:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    S = sum(rows)
    if P > 1:  # every rank must have the same rows: they say who sends what
        B, _, H, d = q.shape
        sig = _signature_of(
            (B, S, H, d), (B, S, k.shape[2], d), q.dtype, device_kind(q), False, "contiguous", strategy,
            float(softmax_scale or 0.0), torch.is_grad_enabled(), int(code(("rows", *rows))), inner_size or 0,
            sinks is not None,
        )  # fmt: skip
        _agree(sig, lambda: get_strategy("ring"), f"rows per rank {list(rows)}, {q.dtype}", group, rank, P)
    target, moves = even_out(rows)
    mine = target[rank]
    q2, k2, v2 = (move_rows(t, moves, mine, group) for t in (q, k, v))
    out = attention(
        q2, k2, v2, softmax_scale=softmax_scale, strategy=strategy, layout="contiguous", sinks=sinks, group=group,
        inner_size=inner_size, seq_len=S,
    )  # fmt: skip
    return move_rows(out, moves, q.shape[1], group, back=True) if moves else out


def _ragged_rows(q, k, v, rows, causal, cu_seqlens, window, seq_len, rank: int, P: int) -> tuple[int, ...]:
    """``rows`` checked: P whole counts, not all zero, this rank's matching q, k, v; attention with no order."""
    if causal or cu_seqlens is not None or window is not None:
        raise ValueError(
            "rows= (any rows per rank) is for attention whose rows have no order: not causal, without "
            "cu_seqlens or a window. Shard an ordered sequence with tokenring.shard() and pass seq_len= instead"
        )
    rows = tuple(whole_numbers(rows, "rows"))
    if len(rows) != P or min(rows) < 0 or sum(rows) < 1:
        raise ValueError(
            f"rows={list(rows)}: give each of the {P} ranks' row counts, in rank order (zero or more, at least one "
            f"row in all)"
        )
    if seq_len is not None and int(seq_len) != sum(rows):
        raise ValueError(f"seq_len={seq_len} but rows={list(rows)} add up to {sum(rows)}: they must agree")
    if any(t.shape[1] != rows[rank] for t in (q, k, v)):
        raise ValueError(
            f"q, k, v hold {q.shape[1]}, {k.shape[1]}, {v.shape[1]} rows, but rows={list(rows)} gives rank {rank} "
            f"{rows[rank]}"
        )
    return rows


def _uneven_rows(q, k, v, S: int, layout: str, cu_seqlens, rank: int, P: int) -> int:
    """This rank's row count for length ``S``; a ValueError when it holds another, or the layout takes no padding."""
    if S < 1:
        raise ValueError(f"seq_len={S}: the global length must be at least 1")
    if layout == "zigzag_docs":
        raise ValueError(
            f"layout='zigzag_docs' splits every document into 2P chunks and takes no padding (length {S} over "
            f"{P} ranks); pad each document to a multiple of {2 * P}, or use layout='zigzag'"
        )
    if isinstance(cu_seqlens, (list, tuple)) and len(cu_seqlens) and int(cu_seqlens[-1]) != S:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, but seq_len={S}: they must agree")
    docs = cu_seqlens if layout in PLANNED_LAYOUTS else None  # the plan follows the documents
    mine = len(shard_positions(S, P, rank, layout, cu_seqlens=docs)) if layout in LAYOUTS else q.shape[1]
    if any(t.shape[1] != mine for t in (q, k, v)):
        raise ValueError(
            f"q, k, v hold {q.shape[1]}, {k.shape[1]}, {v.shape[1]} rows; a sequence of {S} tokens over {P} ranks "
            f"with layout={layout!r} gives rank {rank} {mine} (tokenring.shard(x, layout={layout!r}) cuts it so)"
        )
    return mine


def _checked_plan(q, k, v, sinks, cu, cu_seqlens, strategy, causal, softmax_scale, layout, window, group, inner_size,
                  backward: bool, compiling: bool, rank: int):  # fmt: skip
    """This rank's checks of its arguments, then :func:`tokenring.ops.plan` (ValueError for what it refuses)."""
    _check_local(q, k, v, rank)
    _check_sinks(sinks, q, rank)
    if cu is not None:
        check_bounds_tensor(cu)
    frozen_cu = None if cu_seqlens is None or cu is not None else _frozen(cu_seqlens)
    if not compiling:
        return plan(
            tuple(q.shape), tuple(k.shape), q.dtype, device_kind(q), strategy, causal, softmax_scale, layout,
            frozen_cu, cu is not None, _frozen(window), sinks is not None, _group_name(group), inner_size, backward,
            False,
        )  # fmt: skip
    from torch.fx.experimental import symbolic_shapes  # only when tracing (0.5 s of import)

    if isinstance(softmax_scale, (int, float)):  # a float attribute is symbolic under dynamic=True: a guard fixes it
        softmax_scale = symbolic_shapes.guard_scalar(softmax_scale)
    if window is not None:
        window = tuple(symbolic_shapes.guard_scalar(w) if isinstance(w, (int, float)) else w for w in window)
    return plan(
        _constant_shape(q), _constant_shape(k), q.dtype, device_kind(q), strategy, causal, softmax_scale, layout,
        frozen_cu, cu is not None, _frozen(window), sinks is not None, _group_name(group), inner_size, backward, True,
        not _static(q.shape[1]),
    )  # fmt: skip


# What dynamo traces without a guard: a symbolic size's hint (torch < 2.10: the size), whether a size is symbolic.
def _shape_fns():
    """symbolic_shapes' ``optimization_hint`` and ``has_static_value`` (imported when tracing: 0.5 s), the
    functions themselves, which dynamo knows."""
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", lambda x: x)
    static = getattr(symbolic_shapes, "has_static_value", lambda x: not isinstance(x, torch.SymInt))
    return hint, static


def _hint(x):
    return _shape_fns()[0](x)


def _static(x) -> bool:
    return _shape_fns()[1](x)


def _constant_shape(t: torch.Tensor) -> tuple:
    """``t``'s shape as the constant plan takes it under ``torch.compile``: batch and length (symbolic under
    dynamic shapes) by their hints, without a guard (the op checks the length it runs: :attr:`Call.recheck`);
    heads and head dim by a guard (they fix the scale and what the plan checked)."""
    shape = tuple(_hint(x) for x in t.shape)
    if t.shape[2] != shape[2] or t.shape[3] != shape[3]:  # a guard, never taken when traced
        raise AssertionError(f"tokenring: traced for {shape[2]} heads of dim {shape[3]}")
    return shape
