"""The body of ``tokenring.attention`` on ``P > 1`` ranks, as PyTorch custom ops, so ``torch.compile`` sees
one opaque node per attention call.

A call goes: :func:`plan` (what its constants decide: strategy name, scale, layout, checks of this rank's
arguments), then ``tokenring::attention_fwd``, which runs what reads tensor values or talks to other ranks
(the mask from ``cu_seqlens``, the cross-rank signature, the schedule) and returns ``[out, choice, *extra]``:
``choice`` is the strategy that ran (:func:`tokenring.strategies.code`, a small CPU tensor, so the backward
runs the same one), ``extra`` what its backward needs beyond the inputs and ``out``
(:meth:`~tokenring.strategies.base.Strategy.extra_like`). ``tokenring::attention_bwd`` returns
``[dq, dk, dv]`` (+ ``dsinks``). Their fake implementations give those shapes without running anything.

The signature (:func:`agree`): every rank's shapes and options, compared once per (group, signature) through
:mod:`tokenring.agreement`; rank 0's strategy choice travels with it, so no per-host input (cores, a topology
set on one rank) can make the ranks disagree. Under ``torch.compile`` the fake implementation needs the
concrete strategy at trace time: :func:`trace_choice` takes the choice an earlier eager call agreed on for
these shapes, else this rank's cost model; the signature check at run time still refuses, on every rank,
ranks that traced different strategies.
"""

from __future__ import annotations

import weakref
from copy import copy
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from . import settings
from .agreement import cache, exchange, require_same
from .agreement import code as _code
from .choice import resolve
from .comm import process_group, publish_refusal
from .device import device_type as device_kind
from .device import no_autocast, pretended
from .instrument import NONE as NO_HOOKS
from .kernels import fold_scale, softmax_scale_of
from .layouts import (
    AUTO_LAYOUT,
    DOCUMENT_LAYOUTS,
    LAYOUTS,
    PLANNED_LAYOUTS,
    auto_inputs,
    check_layout,
    default_layout,
    document_bounds,
    group_info,
    resolve_layout,
)
from .masks import make_mask, whole_numbers, window_pair
from .single import SINGLE
from .strategies import CODE_LEN, NAMES, from_code, node_size, with_node_size
from .strategies import code as strategy_code
from .strategies import get as get_strategy
from .strategies.base import Config, Lowered

__all__ = [
    "attention_op",
    "Call",
    "plan",
    "register_extras",
    "IdentityCache",
    "forget_choices",
    "set_calibrator",
    "placed_layout",
]

# A call's tokenring.instrument() fields travel into the op as an id (ops take no Python objects); eager only.
# The forward's ctx holds the object, so an entry lives as long as the autograd graph that may still run its
# backward.
_EXTRAS: "weakref.WeakValueDictionary[int, _Extras]" = weakref.WeakValueDictionary()


class _Extras:
    def __init__(self, hooks):
        self.hooks = hooks


def register_extras(hooks) -> tuple[int, object]:
    """An id for ``hooks`` (a :class:`tokenring.instrument.Instruments`; 0: none) and the object that keeps it
    alive."""
    if hooks is None:
        return 0, None
    holder = _Extras(hooks)
    _EXTRAS[id(holder)] = holder
    return id(holder), holder


def _extras(extras_id: int):
    if not extras_id:
        return None
    holder = _EXTRAS.get(extras_id)
    if holder is None:
        raise RuntimeError(
            "tokenring: the instrumentation (tokenring.instrument) of this call is gone; run "
            "backward while the forward's graph is alive"
        )
    return holder.hooks


class IdentityCache:
    """Results keyed by the identity of tensors (and their in-place version), for checks that read values:
    the layers of one forward pass get the same tensors, so only the first pays (no sync, no collective in
    the others). A key holds weak references only; a freed tensor's entry is never reused."""

    def __init__(self, size: int = 64):
        self.size, self.entries = size, {}

    @staticmethod
    def _key(tensors) -> tuple | None:
        """``None`` for inference tensors: they keep no version counter, so nothing about them is cached."""
        if any(t is not None and t.is_inference() for t in tensors):
            return None
        return tuple((id(t), t._version) if t is not None else None for t in tensors)

    def get(self, tensors):
        key = self._key(tensors)
        hit = self.entries.get(key) if key is not None else None
        if hit is None or any((r() if r is not None else None) is not t for r, t in zip(hit[0], tensors)):
            return None
        return hit[1]

    def put(self, tensors, value) -> None:
        key = self._key(tensors)
        if key is None:
            return
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = ([weakref.ref(t) if t is not None else None for t in tensors], value)


def placed_layout(layout: str, S: int, P: int, cu_seqlens) -> str:
    """:func:`tokenring.layouts.resolve_layout` for a model's layers (``cu_seqlens``: the batch's documents,
    ``None`` for an unpacked one: zigzag), once per documents tensor and settings: the layers of a forward share
    that tensor."""
    if layout != AUTO_LAYOUT:
        return layout
    cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens)
    how = (S, P, auto_inputs())
    hit = _placed.get([cu]) if cu is not None else None
    if hit is not None and hit[0] == how:
        return hit[1]
    placed = resolve_layout(layout, S, P, None if cu is None else cu.cpu())
    if cu is not None:
        _placed.put([cu], (how, placed))
    return placed


_placed = IdentityCache()


@dataclass(frozen=True)
class Call:
    """What a call's op carries besides tensors. The custom ops take plain arguments: :meth:`args` flattens a
    call once at the op boundary, and the op bodies rebuild it."""

    strategy: str
    causal: bool
    scale: float
    layout: str
    window: Optional[List[int]]
    group: str  # the process group's name ("": the default group)
    inner: int  # ranks per node (0: unknown)
    backward: bool
    extras: int  # register_extras' id of the call's tokenring.instrument() fields (0: none)
    recheck: bool = False  # traced over a symbolic length: the op checks the length it runs (plan could not)
    refused: str = ""  # traced and refused by the plan: the op raises this, on every rank, when it runs

    def args(self) -> tuple:
        window = list(self.window) if self.window is not None else None
        return (self.strategy, self.causal, self.scale, self.layout, window, self.group, self.inner, self.backward,
                self.extras, self.recheck, self.refused)  # fmt: skip

    def backward_args(self) -> tuple:
        """The backward op's options (its strategy is the one the forward ran)."""
        window = list(self.window) if self.window is not None else None
        return self.causal, self.scale, self.layout, window, self.group, self.extras


_checked = cache()  # (id(group), signature) -> the strategy every rank agreed to run


def forget_choices() -> None:
    """Drop the verified signatures and the cached ``auto`` choices, so the next call of each signature is agreed
    and decided again. Call it on every rank: a rank that forgot alone would ask the others, who do not."""
    _checked.clear()
    _ready.clear()


_calibrate: Callable | None = None  # set_calibrator: tokenring.calibration, which sits above this module
_calibrated: set = set()  # ids of the groups calibrated in this process (the calibrate setting)


def set_calibrator(fn: Callable) -> None:
    """``fn(group, q, k)`` calibrates ``group`` for calls shaped like ``q`` / ``k`` when the ``calibrate``
    setting is on (``tokenring`` registers :func:`tokenring.calibration.calibrate_group` at import)."""
    global _calibrate
    _calibrate = fn


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
    where = f"rank {rank}: "
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{where}{name} has shape {tuple(t.shape)}; expected 4 dims (batch, seq_local, heads, "
                f"head_dim), the flash-attn layout"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"{where}k {tuple(k.shape)} and v {tuple(v.shape)} must have the same batch, length and heads (v's "
            f"head dim may differ from q/k's, as in MLA)"
        )
    B, s, H, d = q.shape
    for what, i, name in (
        ("batch", 0, "batch size"),
        ("seq_local", 1, "local sequence length"),
        ("head_dim", 3, "head dim"),
    ):
        if k.shape[i] != q.shape[i]:
            raise ValueError(
                f"{where}q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in {name} (dim {i}, "
                f"{what}); q and k/v must be shards of the same tokens"
            )
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"{where}q has {H} heads and k/v {Hkv}: the query heads must be a multiple of the "
            f"key/value heads (MHA: equal, GQA: H % Hkv == 0, MQA: Hkv == 1)"
        )
    if 0 in q.shape:
        raise ValueError(
            f"{where}q has shape {tuple(q.shape)}: batch, local length, heads and head dim must be positive"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not q.is_floating_point():
        raise ValueError(f"{where}q has dtype {q.dtype}; attention needs floating point inputs")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{where}q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one device"
        )


def _check_sinks(sinks, q: torch.Tensor, rank: int) -> None:
    if sinks is None:
        return
    H = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or not sinks.is_floating_point():
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"rank {rank}: sinks must be a floating point tensor of shape ({H},) (one logit per query "
            f"head), got {shape}"
        )
    if sinks.device != q.device:
        raise ValueError(f"rank {rank}: sinks are on {sinks.device} and q on {q.device}; move them to one device")


def _ranked(e: ValueError, rank: int) -> ValueError:
    return e if str(e).startswith(f"rank {rank}:") else ValueError(f"rank {rank}: {e}")


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def _frozen(x):
    """Lists (cu_seqlens, window) as tuples, so that the plan is a function of constants."""
    if x is None or isinstance(x, (int, float)):
        return x
    try:
        return tuple(_frozen(y) for y in x)
    except TypeError:
        return x


def _constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing dynamo at ``import tokenring`` (1.4 s of the
    import): that decorator only marks the function, which dynamo reads when it traces a call to it."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_result
def plan(
    q_shape, k_shape, dtype, device_type: str, strategy: str, causal: bool, softmax_scale, layout, cu_list,
    cu_tensor: bool, window, sinks: bool, group_name: str, inner_size, backward: bool, compiling: bool,
    dynamic: bool = False,
):  # fmt: skip
    """What can be decided from the call's constants (shapes, dtypes, options), before any value is read or a
    rank is asked: ``(strategy, scale, layout, window, node size, cu_seqlens list, plain, shortest, refused)``.
    ValueError for what this rank refuses. Under ``torch.compile`` it runs once per trace (a constant of the
    graph), also picks the concrete strategy (:func:`trace_choice`), and returns a refusal as ``refused`` (the op
    raises it at run time: dynamo would turn a ValueError here into its own error). ``dynamic``: the local
    length in ``q_shape`` is a symbolic length's hint, so nothing is decided by it that another length could
    change: its checks and the mask run in the op (:attr:`Call.recheck`), and ``shortest`` is the local length
    below which a strategy ``auto`` chose cannot run (a guard there retraces). ``plain``: one rank and no mask
    or sinks (PyTorch's SDPA)."""
    try:
        return (*_plan(q_shape, k_shape, dtype, device_type, strategy, causal, softmax_scale, layout, cu_list,
                       cu_tensor, window, sinks, group_name, inner_size, backward, compiling, dynamic), "")  # fmt: skip
    except ValueError as e:
        if not compiling:
            raise
        layout = layout if layout in LAYOUTS else default_layout(causal)
        return "ring", 1.0, layout, None, 0, None, False, 0, str(e)


def _plan(
    q_shape, k_shape, dtype, device_type: str, strategy: str, causal: bool, softmax_scale, layout, cu_list,
    cu_tensor: bool, window, sinks: bool, group_name: str, inner_size, backward: bool, compiling: bool,
    dynamic: bool,
):  # fmt: skip
    """:func:`plan`'s body, raising what it refuses."""
    group = resolve_group(group_name)
    rank, P = group_info(group)
    layout = layout if layout is not None else default_layout(causal)
    n = node_size(inner_size)
    if strategy != "auto":  # unknown names fail here, before any communication
        strategy = with_node_size(get_strategy(strategy), n).name
    check_layout(layout)
    s, d = q_shape[1], q_shape[3]
    scale = softmax_scale_of(softmax_scale, d)
    cu_list = whole_numbers(cu_list, "cu_seqlens") if cu_list is not None else None
    window = list(window_pair(window)) if window is not None else None
    _check_shards(q_shape[2], k_shape[2], None if dynamic else s, P, strategy, causal, layout)
    by_docs = layout in DOCUMENT_LAYOUTS
    if not dynamic and (cu_list is not None or (by_docs and not cu_tensor) or window is not None):
        _mask_of(s, P, cu_list, window, causal, layout)  # malformed documents / windows fail here (a tensor: later)
    # a window may cover one length whole and not another
    windowed = window is not None if dynamic else make_mask(s, None, window, causal) is not None
    masked = cu_list is not None or cu_tensor or by_docs or windowed
    plain = P == 1 and not masked and not sinks
    shortest = 0
    if compiling and P > 1:
        documents = cu_list is not None or cu_tensor
        zigzag = causal and layout == "zigzag"
        if dynamic and _check_length(q_shape[2], k_shape[2], s, P, strategy, causal, layout):
            q_shape = (q_shape[0], None, *q_shape[2:])  # a length refused (at run time): choose by heads only
        chosen = trace_choice(q_shape, k_shape, dtype, device_type, strategy, causal, layout, window, documents,
                              backward, group, n, scale, sinks)  # fmt: skip
        if dynamic and chosen != strategy and q_shape[1] is not None:
            shortest = _shortest(chosen, q_shape[2], k_shape[2], s, P, zigzag)
        strategy = chosen
    return strategy, scale, layout, window, n, cu_list, plain, shortest


def _check_length(H: int, Hkv: int, s: int, P: int, strategy: str, causal: bool, layout: str) -> str | None:
    """Why :func:`_check_shards` refuses local length ``s`` (``None``: it does not)."""
    try:
        _check_shards(H, Hkv, s, P, strategy, causal, layout)
    except ValueError as e:
        return str(e)
    return None


def _shortest(strategy: str, H: int, Hkv: int, s: int, P: int, zigzag: bool) -> int:
    """The shortest local length from which on the variant ``strategy`` (which runs ``s``) runs: its checks ask
    for enough rows per chunk, more as the length falls (a bisection)."""
    st = get_strategy(strategy)
    lo, hi = 1, s
    while lo < hi:
        mid = (lo + hi) // 2
        if st.check(H, Hkv, P, mid, zigzag) is None:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_shards(H: int, Hkv: int, s: int, P: int, strategy: str, causal: bool, layout: str) -> None:
    """ValueError when the local length does not fit the layout or a named strategy cannot run these heads
    (``s`` ``None``: the heads only)."""
    if P > 1 and layout == "zigzag" and s is not None and s % 2:
        raise ValueError(
            f"layout='zigzag' needs an even local length (two chunks per rank), got {s}; for a sequence of any "
            f"length shard it with tokenring.shard(x, layout='zigzag') and pass seq_len= (its length)"
        )
    if P > 1 and strategy != "auto":
        st = get_strategy(strategy)
        why = st.check(H, Hkv, P, s, causal and layout == "zigzag")
        if st.node_rows and layout in PLANNED_LAYOUTS:
            why = (
                f"{strategy!r} runs its ring over whole nodes' rows, which layout={layout!r} does not nest into; "
                f"use another strategy (auto leaves it out), or layout='zigzag_docs'"
            )
        if why:
            raise ValueError(why)


def trace_choice(
    q_shape,
    k_shape,
    dtype,
    device_type: str,
    strategy: str,
    causal: bool,
    layout: str,
    window,
    documents: bool,
    backward: bool,
    group,
    inner: int,
    scale: float,
    sinks: bool,
) -> str:
    """The concrete strategy a traced (``torch.compile``) call runs: a named variant itself; for ``"auto"`` or a
    family choice, the one an eager call agreed on for these shapes (documents aside), else this rank's cost
    model (without the documents, whose bounds are values)."""
    st = get_strategy(strategy) if strategy != "auto" else None
    if st is not None and st.mode != "auto":
        return strategy
    rank, P = group_info(group)
    if q_shape[1] is None:  # no length to choose by: the shape-free rule (any length runs it)
        return resolve(strategy, tuple(q_shape), tuple(k_shape), P, inner_size=inner or None).name
    S = q_shape[1] * P
    if documents and layout in DOCUMENT_LAYOUTS:  # placed by documents, which are values: one stands in
        mask = make_mask(S, None, window, causal, force=True)
    else:
        mask = None if documents else make_mask(S, None, window, causal)
    sig = _signature_of(
        q_shape,
        k_shape,
        dtype,
        device_type,
        causal,
        layout,
        strategy,
        scale,
        backward,
        mask.key if mask is not None else 0,
        inner,
        sinks,
    )
    hit = _checked.get((id(group), tuple(sig)))
    if hit is not None:
        return hit.name
    return resolve(
        strategy,
        tuple(q_shape),
        tuple(k_shape),
        P,
        dtype=dtype,
        causal=causal,
        layout=layout,
        backward=backward,
        device_type=device_type,
        mask=mask,
        inner_size=inner or None,
    ).name


def _signature_of(
    q_shape,
    k_shape,
    dtype,
    device_type: str,
    causal,
    layout,
    strategy,
    scale,
    backward,
    mask_code: int,
    inner: int,
    sinks: bool,
) -> list[float]:
    B, s, H, d = q_shape
    return [
        0.0,
        B,
        s,
        H,
        k_shape[2],
        d,
        _code(str(dtype)),
        _code(device_type),
        float(causal),
        LAYOUTS.index(layout),
        _code(strategy),
        scale,
        float(backward),
        float(mask_code),
        float(inner),
        float(sinks),
    ]


def _signature(
    q, k, causal, layout, strategy, scale, backward, mask_code: int, inner: int, sinks: bool = False
) -> list[float]:
    return _signature_of(
        q.shape, k.shape, q.dtype, device_kind(q), causal, layout, strategy, scale, backward, mask_code, inner, sinks
    )


_FIELDS = [
    "refused",
    "batch",
    "local length",
    "query heads",
    "key/value heads",
    "head dim",
    "dtype",
    "device type",
    "causal",
    "layout",
    "strategy",
    "softmax_scale",
    "backward (inputs requiring grad)",
    "cu_seqlens / window (checksum)",
    "inner_size (ranks per node)",
    "sinks (given)",
]

# What a rank that refuses its own arguments sends: the flag, and nothing the others could compare.
_REFUSED = [1.0] + [0.0] * (len(_FIELDS) - 1)


def _show(field: str, value: float) -> str:
    if field == "strategy":
        return next((repr(n) for n in NAMES if _code(n) == value), f"a spec with code {int(value)}")
    return f"{value:g}" if field in ("softmax_scale",) else str(int(value))


def _agree(
    sig: list[float], decide, describe: str, group, rank: int, P: int, remember: bool = True, calibrate_for=None
):
    """Verify that every rank calls with the same shapes and options, and return the strategy to run.

    ``decide()`` resolves the strategy; only rank 0 calls it (``auto`` runs the cost model there) and its
    answer travels with the signature exchange. Done once per (group, signature); later calls reuse the
    result. ``remember=False`` (a rank that will refuse its arguments): exchange every time, never skip.
    ``decide`` ``None``: this rank refuses its arguments (``sig`` is ``_REFUSED``). The ``check_calls`` setting
    (the same on every rank): exchange at every call, so that a rank refusing its arguments on a signature the
    others verified earlier meets them in this exchange, not in the schedule."""
    key = (id(group), tuple(sig))  # nothing per-host in it: a rank that re-checked alone would wait for the others
    known = _checked.get(key) if remember else None
    if known is not None and not settings.get("check_calls"):
        return known
    lazy = rank == 0 and calibrate_for is not None and settings.get("calibrate") and id(group) not in _calibrated
    if rank == 0 and decide is not None and not lazy:
        choice = strategy_code(known if known is not None else decide())
    else:
        choice = [-1.0] * CODE_LEN
    check = float(settings.get("check_calls"))  # compared, not part of the key: ranks must skip alike
    rows = exchange(sig + choice + [check, float(lazy)], group, rank, P, "tokenring.attention", "call signatures")
    if rows is None:  # PyTorch's fake process group: nothing to compare, each rank decides
        if decide is None:
            return None
        chosen = _checked[key] = get_strategy(decide().name)
        return chosen
    refused = [r for r, row in enumerate(rows) if row[0]]
    if refused:  # a refusing rank raises its own error; the others say who refused, at the same moment
        raise ValueError(
            f"tokenring: rank(s) {refused} refused their arguments to attention (each raised an error "
            f"saying why); here: {describe}"
        )
    checking = [r for r, row in enumerate(rows) if row[-2]]
    if checking and len(checking) < P:
        raise ValueError(
            f"tokenring.attention (rank {rank}): the check_calls setting is on for rank(s) {checking} only; set "
            f"tokenring.configure(check_calls=...) (or $TOKENRING_CHECK_CALLS) alike on every rank"
        )
    require_same(
        rows,
        _FIELDS,
        rank,
        "tokenring.attention",
        f"Here: {describe}. Every rank must pass shards of the same shape, dtype and options; shard the "
        f"sequence with tokenring.shard(), and for a length the layout does not split evenly pass seq_len= "
        f"(the global length) on every rank; attention without order (not causal, no documents or window) "
        f"takes any rows per rank with rows= (every rank's count, the same list on every rank).",
        _show,
    )
    if rows[0][-1]:  # rank 0 asks every rank to calibrate the group first
        _calibrate(group, *calibrate_for)
        _calibrated.add(id(group))
        return _agree(sig, decide, describe, group, rank, P, remember, calibrate_for)
    chosen = from_code(rows[0][-CODE_LEN - 2 : -2])
    if remember:
        _checked[key] = chosen
    return chosen


def _refuse_everywhere(problem: ValueError, group, rank: int, P: int):
    """Tell the other ranks this rank refuses its arguments, then raise ``problem``. Ranks that compare
    signatures for this call raise at once; ranks that had agreed on their shapes at an earlier call go ahead
    without comparing, and name this rank and its reason when its messages do not come (the store report)."""
    publish_refusal(group, rank, str(problem))
    try:
        _agree(list(_REFUSED), None, "", group, rank, P, remember=False)
    except ValueError:  # its own error is the one to raise
        pass
    except RuntimeError:
        raise ValueError(
            f"{problem} (The other ranks did not compare signatures with this one: they had agreed on their "
            f"shapes at an earlier call and went ahead, so they will fail waiting for this rank and name it. "
            f"The process group cannot be used again after this: destroy it and start the ranks again. "
            f"tokenring.configure(check_calls=True) on every rank makes such a refusal a ValueError on every "
            f"rank, the group usable, at one small exchange per call.)"
        ) from None
    raise problem from None


def _describe(q, k, causal, layout, strategy, mask, sinks) -> str:
    return (
        f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}, causal={causal}, layout={layout}, "
        f"strategy={strategy!r}"
        + (f", {mask.describe()}" if mask is not None else "")
        + (", with sinks" if sinks is not None else "")
    )


def _config_of(group, rank, P, causal, layout, scale, mask, sinks, hooks) -> Config:
    return Config(
        group=group,
        rank=rank,
        P=P,
        causal=causal,
        layout=layout,
        scale=scale,
        mask=mask,
        sinks=sinks,
        hooks=hooks or NO_HOOKS,
    )


_masks = IdentityCache()


def _mask_of(s: int, P: int, cu, window, causal: bool, layout: str):
    """The call's mask; reading ``cu_seqlens`` once per tensor (the layers of a model share it)."""
    key = (s, P, tuple(window) if window is not None else None, causal, layout)
    cached = isinstance(cu, torch.Tensor)
    hit = _masks.get([cu]) if cached else None
    if hit is not None and hit[0] == key:
        return hit[1]
    if layout in DOCUMENT_LAYOUTS:
        document_bounds(s * P, P, cu, layout)  # zigzag_docs: every document must split over the ranks
    mask = make_mask(s * P, cu, window, causal, force=layout in DOCUMENT_LAYOUTS)
    if cached:
        _masks.put([cu], (key, mask))
    return mask


def _single_device(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


@dataclass(frozen=True)
class Ready:
    """What a call's constants and agreement decided, ready to run on its tensors: the strategy and its
    :class:`~tokenring.strategies.base.Config` (the scale before folding; no sinks or instruments, a call's own;
    no group object, which a cached Ready would keep alive: ``call.group`` names it).
    ``agreed``: the agreement's cache key, whose entry must still stand for a repeated call to skip the
    agreement (:func:`ready_again`)."""

    strat: object
    cfg: Config
    call: Call
    agreed: tuple | None
    # its repeats' "forward" / "backward": (a weak reference to the group it ran on, the strategy's replay), made
    # by the second call that ran it the long way (_remember)
    memo: dict = field(default_factory=dict, compare=False, repr=False)


def prepare_forward(q, k, sinks, cu, call: Call) -> Ready:
    """The part of :func:`run_forward` that reads no values of q, k, v: the mask, the cross-rank agreement."""
    strategy, causal, scale, layout, window = call.strategy, call.causal, call.scale, call.layout, call.window
    group, backward, n = resolve_group(call.group), call.backward, call.inner
    rank, P = group_info(group)
    try:
        if call.refused:
            raise ValueError(call.refused)
        if call.recheck:  # traced over a symbolic length: its checks, for the length this call runs
            _check_shards(q.shape[2], k.shape[2], q.shape[1], P, strategy, causal, layout)
        mask = _mask_of(q.shape[1], P, cu, window, causal, layout)
    except ValueError as e:
        if P == 1:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    if P == 1:
        return Ready(SINGLE, _config_of(None, rank, P, causal, layout, scale, mask, None, None), call, None)

    def decide():  # a concrete variant; for "auto" / a family choice the cost model, run on rank 0 only
        return resolve(
            strategy,
            q.shape,
            k.shape,
            P,
            dtype=q.dtype,
            causal=causal,
            layout=layout,
            backward=backward,
            device_type=device_kind(q),
            mask=mask,
            inner_size=n or None,
        )

    sig = _signature(
        q, k, causal, layout, strategy, scale, backward, mask.key if mask is not None else 0, n, sinks is not None
    )
    auto = strategy == "auto" or get_strategy(strategy).mode == "auto"
    strat = _agree(
        sig,
        decide,
        _describe(q, k, causal, layout, strategy, mask, sinks),
        group,
        rank,
        P,
        calibrate_for=(q, k) if auto else None,
    )
    cfg = _config_of(None, rank, P, causal, layout, scale, mask, None, None)  # (the group by name: call.group)
    return Ready(strat, cfg, call, (id(group), tuple(sig)))


def run_ready(ready: Ready, q, k, v, sinks, hooks):
    """The forward of a prepared call: ``(out, strategy, extra)`` (``extra``: what backward needs besides the
    inputs and ``out``)."""
    q, scale = fold_scale(q, ready.cfg.scale)
    group, strat, memo = resolve_group(ready.call.group), ready.strat, ready.memo
    plain = sinks is None and hooks is None
    replay = _replay(memo, "forward", group) if plain else None
    if replay is not None:  # a repeat of a prepared call on the same group
        out, extra = replay(*strat.prepare(q, k, v, ready.cfg.P), group)
        return out, strat, extra
    cfg = copy(ready.cfg)  # (what dataclasses.replace makes, without its per-field checks)
    cfg.group, cfg.scale, cfg.sinks, cfg.hooks = group, scale, sinks, hooks or NO_HOOKS
    if strat is SINGLE:
        out, saved = SINGLE.forward(q, k, v, cfg)
        return out, SINGLE, SINGLE.saved_extra(saved)
    q, k, v = strat.prepare(q, k, v, cfg.P)
    out, saved = strat.forward(q, k, v, cfg)
    if plain and isinstance(strat, Lowered):
        _remember(memo, "forward", group, lambda: strat.forward_replay(q, k, cfg))
    return out, strat, strat.saved_extra(saved)


def _replay(memo: dict | None, what: str, group) -> Callable | None:
    """The replay ``memo`` (a :class:`Ready`'s) holds for ``what`` on ``group``, if it holds one."""
    hit = memo.get(what) if memo is not None else None
    return hit[1] if hit is not None and hit[0]() is process_group(group) else None


def _remember(memo: dict, what: str, group, make: Callable) -> None:
    """After a call of a :class:`Ready` ran ``what`` the long way: its replay, made by ``make()``, from its second
    such call on (a Ready run once, as the custom op's are, makes none)."""
    if memo.get(f"seen {what}"):
        replay = make()
        memo[what] = None if replay is None else (weakref.ref(process_group(group)), replay)
    memo[f"seen {what}"] = True


def run_forward(q, k, v, sinks, cu, call: Call):
    """The forward of :func:`attention` on ``P > 1`` ranks once its local arguments are checked (the body of
    the ``tokenring::attention_fwd`` op): the mask, the cross-rank agreement, the strategy's schedule.
    Returns ``(out, strategy, extra)`` (``extra``: what backward needs besides the inputs and ``out``)."""
    return run_ready(prepare_forward(q, k, sinks, cu, call), q, k, v, sinks, _extras(call.extras))


_ready = cache()  # (the group's name, a plain eager call's arguments) -> its Ready


def ready_again(key, anchor: torch.Tensor | None = None) -> Ready | None:
    """The :class:`Ready` of an earlier plain eager call with these arguments, while its agreement stands
    (the entry skipped exactly when the agreement would be: never under ``check_calls``). ``anchor``: the
    documents tensor the key names by identity, which must be that very tensor still (an id can be reused)."""
    hit = _ready.get(key)
    if hit is None:
        return None
    ready, ref = hit
    if (ref is not None and ref() is not anchor) or _checked.get(ready.agreed) is not ready.strat:
        return None
    return None if settings.get("check_calls") else ready


def remember_ready(key, ready: Ready, anchor: torch.Tensor | None = None) -> None:
    if ready.agreed is not None and _checked.get(ready.agreed) is ready.strat:
        _ready[key] = (ready, weakref.ref(anchor) if anchor is not None else None)


def run_backward(dout, q, k, v, out, sinks, cu, strat, extra: list, call: Call, ready: Ready | None = None):
    """The backward of :func:`run_forward` (the body of ``tokenring::attention_bwd``): ``[dq, dk, dv]``, and
    ``dsinks`` (this rank's rows' share) with sinks; ``ready``: the forward's, with its mask."""
    causal, scale, layout = call.causal, call.scale, call.layout
    if ready is not None:
        group, rank, P, mask = resolve_group(call.group), ready.cfg.rank, ready.cfg.P, ready.cfg.mask
    else:
        group = resolve_group(call.group)
        rank, P = group_info(group)
        mask = _mask_of(q.shape[1], P, cu, call.window, causal, layout)
    q_in, (q, folded) = q, fold_scale(q, scale)
    hooks = _extras(call.extras)
    memo = ready.memo if ready is not None and sinks is None and hooks is None else None
    replay = _replay(memo, "backward", group)
    if replay is not None:  # a repeat of a prepared call on the same group
        dq, dk, dv = replay(dout, strat.saved_full(extra, q, k, v, out), group)
        dsinks = None
    else:
        cfg = _config_of(group, rank, P, causal, layout, folded, mask, sinks, hooks)
        dq, dk, dv, dsinks = strat.backward(dout, strat.saved_full(extra, q, k, v, out), cfg)
        if memo is not None and isinstance(strat, Lowered):
            _remember(memo, "backward", group, lambda: strat.backward_replay(q, k, cfg))
    dk, dv = strat.unprepare(dk, dv, k.shape[2])
    if folded != scale:
        dq = dq * scale
    return [dq.to(q_in.dtype), dk, dv] + ([dsinks.to(sinks.dtype)] if sinks is not None else [])


def fake_extra(q, k, v, cu, call: Call):
    """Empty tensors shaped like :func:`run_forward`'s ``extra`` for a concrete ``strategy`` (the op's fake)."""
    strategy, causal, layout, group = call.strategy, call.causal, call.layout, resolve_group(call.group)
    rank, P = group_info(group)
    if call.refused:  # the op raises before it returns anything
        return []
    st = get_strategy(strategy) if P > 1 else SINGLE
    if P > 1 and (strategy == "auto" or st.mode == "auto"):
        raise ValueError(f"tokenring: strategy {strategy!r} must be resolved before tracing (tokenring.ops)")
    mask = None
    if st.keep:
        if cu is not None or layout in DOCUMENT_LAYOUTS:
            raise ValueError(
                f"tokenring: {strategy!r} keeps K/V pieces whose shapes depend on cu_seqlens' values; "
                f"under torch.compile use it without 'keep' or without documents"
            )
        mask = make_mask(q.shape[1] * P, None, call.window, causal)
    cfg = Config(group=group, rank=rank, P=P, causal=causal, layout=layout, scale=1.0, mask=mask)
    q, k, v = st.prepare(q, k, v, P)
    return st.extra_like(q, k, v, cfg)


def _pretended_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain meta tensor inside ``pretend_cuda`` (the dispatcher sends meta tensors to an op's
    fake implementation; there they stand for CUDA tensors and take the real one). Tracing's fake tensors are
    not."""
    return pretended() is not None and t.device.type == "meta" and not isinstance(t, FakeTensor)


def resolve_group(name: str):
    """The process group named ``name`` (``""``: the default group)."""
    if not name:
        return None
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("tokenring::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    strategy: str,
    causal: bool,
    scale: float,
    layout: str,
    window: Optional[List[int]],
    group: str,
    inner: int,
    backward: bool,
    extras: int,
    recheck: bool,
    refused: str,
) -> List[torch.Tensor]:
    with no_autocast(q):  # the inputs are already in the autocast dtype
        call = Call(strategy, causal, scale, layout, window, group, inner, backward, extras, recheck, refused)
        out, strat, extra = run_forward(q, k, v, sinks, cu_seqlens, call)
    return [out, _choice(strat), *_unaliased([out, *extra], (q, k, v))[1:]]


def _choice(strat) -> torch.Tensor:
    """The strategy that ran, as numbers (-1: one rank, :data:`tokenring.single.SINGLE`)."""
    return torch.tensor([-1.0] * CODE_LEN if strat is SINGLE else strategy_code(strat), dtype=torch.float64)


def _chosen(choice: torch.Tensor):
    values = choice.tolist()
    return SINGLE if values[0] < 0 else from_code(values)


def _unaliased(outputs: list, inputs) -> list:
    """``outputs`` with copies where two share storage or one shares an input's (a custom op's outputs may
    not alias): e.g. kept K and V pieces that arrived as views of one message buffer."""

    def base(t):
        return t.untyped_storage().data_ptr()

    count: dict = {}
    for t in list(outputs) + list(inputs):
        count[base(t)] = count.get(base(t), 0) + 1
    return [t.clone() if count[base(t)] > 1 else t for t in outputs]


@attention_fwd.register_fake
def _(q, k, v, sinks, cu_seqlens, *options):
    if _pretended_meta(q):  # tokenring.testing.pretend_cuda: run the CUDA path on meta tensors
        return attention_fwd._init_fn(q, k, v, sinks, cu_seqlens, *options)
    extra = fake_extra(q, k, v, cu_seqlens, Call(*options))
    return [q.new_empty(q.shape), torch.empty(CODE_LEN, dtype=torch.float64), *extra]


@torch.library.custom_op("tokenring::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    sinks: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    choice: torch.Tensor,
    extra: List[torch.Tensor],
    causal: bool,
    scale: float,
    layout: str,
    window: Optional[List[int]],
    group: str,
    extras: int,
) -> List[torch.Tensor]:
    with no_autocast(q):
        call = Call("", causal, scale, layout, window, group, 0, True, extras)
        grads = run_backward(dout, q, k, v, out, sinks, cu_seqlens, _chosen(choice), list(extra), call)
    return list(grads)


@attention_bwd.register_fake
def _(dout, q, k, v, out, sinks, cu_seqlens, choice, extra, *options):
    if _pretended_meta(q):
        return attention_bwd._init_fn(dout, q, k, v, out, sinks, cu_seqlens, choice, extra, *options)
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads + ([sinks.new_empty(sinks.shape)] if sinks is not None else [])


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu, *options = inputs
    ctx.save_for_backward(q, k, v, sinks, cu, *output)
    ctx.call = Call(*options)
    ctx.holder = _EXTRAS.get(ctx.call.extras) if ctx.call.extras else None  # keeps the instrumentation alive
    ctx.has_sinks = sinks is not None


def _backward(ctx, grads):
    q, k, v, sinks, cu, out, choice, *extra = ctx.saved_tensors
    dout = grads[0]
    if dout is None:
        dout = torch.zeros_like(out)
    res = attention_bwd(dout.contiguous(), q, k, v, out, sinks, cu, choice, extra, *ctx.call.backward_args())
    dsinks = res[3] if ctx.has_sinks else None
    return (res[0], res[1], res[2], dsinks) + (None,) * 12


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The ops' bodies without the custom-op dispatch, for plain eager calls: the same forward and backward, with
    the strategy object kept in the context instead of travelling as numbers."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, ready: Ready):
        call = ready.call
        with no_autocast(q):
            out, strat, extra = run_ready(ready, q, k, v, sinks, _extras(call.extras))
        ctx.save_for_backward(q, k, v, sinks, cu, out, *extra)
        ctx.ready, ctx.strat, ctx.has_sinks = ready, strat, sinks is not None
        ctx.holder = _EXTRAS.get(call.extras) if call.extras else None  # keeps the instrumentation alive
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, cu, out, *extra = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        ready = ctx.ready
        with no_autocast(q):
            grads = run_backward(dout, q, k, v, out, sinks, cu, ctx.strat, extra, ready.call, ready)
        return grads[0], grads[1], grads[2], grads[3] if ctx.has_sinks else None, None, None


def _plain_eager(*tensors) -> bool:
    """Whether a call can skip the custom op: eager, plain tensors, no dispatch mode or functorch transform."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)


def attention_op(q, k, v, sinks, cu_seqlens, call: Call) -> torch.Tensor:
    """The forward op's output (the rest of its results are for its backward). Plain eager calls run the op's
    bodies directly (:class:`_Eager`): the custom op's dispatch costs a tenth of a call's host time and imports
    dynamo at the first call; traced calls, fake tensors and tensor subclasses take the op."""
    if _plain_eager(q, k, v, sinks, cu_seqlens):
        return _Eager.apply(q, k, v, sinks, cu_seqlens, prepare_forward(q, k, sinks, cu_seqlens, call))
    return attention_fwd(q, k, v, sinks, cu_seqlens, *call.args())[0]


def eager_ready(ready: Ready, q, k, v, sinks, cu) -> torch.Tensor:
    """:func:`attention_op` for a call prepared before (:func:`ready_again`); without a gradient to record, the
    forward alone."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return _Eager.apply(q, k, v, sinks, cu, ready)
    with no_autocast(q):
        return run_ready(ready, q, k, v, sinks, _extras(ready.call.extras))[0]
