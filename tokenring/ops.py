"""``tokenring.attention`` as PyTorch custom ops, so ``torch.compile`` sees one opaque node per attention call.

``tokenring::attention_fwd`` runs what reads tensor values or talks to other ranks (the mask from
``cu_seqlens``, the cross-rank signature check, the schedule) and returns ``[out, choice, *extra]``:
``choice`` is the strategy that ran (:func:`tokenring.strategies.code`, a small CPU tensor, so the backward
runs the same one), ``extra`` what its backward needs beyond the inputs and ``out``
(:meth:`~tokenring.strategies.base.Strategy.extra_like`). ``tokenring::attention_bwd`` returns
``[dq, dk, dv]`` (+ ``dsinks``). Their fake implementations give those shapes without running anything.

Eager calls with ``strategy="auto"`` (or a family choice) let rank 0 decide inside the op, as before. Under
``torch.compile`` the fake implementation needs the concrete strategy at trace time: :func:`trace_choice`
takes the choice an earlier eager call agreed on for these shapes, else this rank's cost model; the signature
check at run time still refuses, on every rank, ranks that traced different strategies.
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from .device import no_autocast, pretended

__all__ = ["attention_op", "register_extras", "IdentityCache"]

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


def _pretended_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain meta tensor inside ``pretend_cuda`` (the dispatcher sends meta tensors to an op's
    fake implementation; there they stand for CUDA tensors and take the real one). Tracing's fake tensors are
    not."""
    from torch._subclasses.fake_tensor import FakeTensor

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
) -> List[torch.Tensor]:
    from .api import run_forward

    with no_autocast(q):  # the inputs are already in the autocast dtype
        out, strat, extra = run_forward(
            q,
            k,
            v,
            sinks,
            cu_seqlens,
            strategy,
            causal,
            scale,
            layout,
            window,
            resolve_group(group),
            inner,
            backward,
            _extras(extras),
        )
    return [out, _choice(strat), *_unaliased([out, *extra], (q, k, v))[1:]]


def _choice(strat) -> torch.Tensor:
    """The strategy that ran, as numbers (-1: one rank, :data:`tokenring.single.SINGLE`)."""
    from .single import SINGLE
    from .strategies import CODE_LEN, code

    return torch.tensor([-1.0] * CODE_LEN if strat is SINGLE else code(strat), dtype=torch.float64)


def _chosen(choice: torch.Tensor):
    from .single import SINGLE
    from .strategies import from_code

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
def _(q, k, v, sinks, cu_seqlens, strategy, causal, scale, layout, window, group, inner, backward, extras):
    from .api import fake_extra
    from .strategies import CODE_LEN

    if _pretended_meta(q):  # tokenring.testing.pretend_cuda: run the CUDA path on meta tensors
        return attention_fwd._init_fn(
            q, k, v, sinks, cu_seqlens, strategy, causal, scale, layout, window, group, inner, backward, extras
        )
    return [
        q.new_empty(q.shape),
        torch.empty(CODE_LEN, dtype=torch.float64),
        *fake_extra(q, k, v, cu_seqlens, strategy, causal, layout, window, resolve_group(group), inner),
    ]


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
    from .api import run_backward

    with no_autocast(q):
        grads = run_backward(
            dout,
            q,
            k,
            v,
            out,
            sinks,
            cu_seqlens,
            _chosen(choice),
            list(extra),
            causal,
            scale,
            layout,
            window,
            resolve_group(group),
            _extras(extras),
        )
    return list(grads)


@attention_bwd.register_fake
def _(dout, q, k, v, out, sinks, cu_seqlens, choice, extra, causal, scale, layout, window, group, extras):
    if _pretended_meta(q):
        return attention_bwd._init_fn(
            dout, q, k, v, out, sinks, cu_seqlens, choice, extra, causal, scale, layout, window, group, extras
        )
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads + ([sinks.new_empty(sinks.shape)] if sinks is not None else [])


_STATIC = ("causal", "scale", "layout", "window", "group", "extras")


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu, strategy, causal, scale, layout, window, group, inner, backward, extras = inputs
    ctx.save_for_backward(q, k, v, sinks, cu, *output)
    ctx.static = (causal, scale, layout, window, group, extras)
    ctx.holder = _EXTRAS.get(extras) if extras else None  # keeps the instrumentation alive until backward
    ctx.has_sinks = sinks is not None


def _backward(ctx, grads):
    q, k, v, sinks, cu, out, choice, *extra = ctx.saved_tensors
    dout = grads[0]
    if dout is None:
        dout = torch.zeros_like(out)
    res = attention_bwd(dout.contiguous(), q, k, v, out, sinks, cu, choice, extra, *ctx.static)
    dsinks = res[3] if ctx.has_sinks else None
    return (res[0], res[1], res[2], dsinks) + (None,) * 10


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_op(
    q,
    k,
    v,
    sinks,
    cu_seqlens,
    strategy: str,
    causal: bool,
    scale: float,
    layout: str,
    window,
    group: str,
    inner: int,
    backward: bool,
    extras: int,
) -> torch.Tensor:
    """The forward op's output (the rest of its results are for its backward)."""
    return attention_fwd(
        q,
        k,
        v,
        sinks,
        cu_seqlens,
        strategy,
        causal,
        scale,
        layout,
        list(window) if window is not None else None,
        group,
        inner,
        backward,
        extras,
    )[0]
