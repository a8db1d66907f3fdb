"""A sequence mixer's kernel call over a sharded sequence (:mod:`tokenring.recurrence`), in eager mode and as one
custom op, ``tokenring::mixer_kernel``, under ``torch.compile``.

Under compile the plan (numpy, the documents' starts read from a tensor) and the exchange (collectives into
Python lists) would break the graph, so the whole state-passing call runs inside the op, eagerly, on the real
tensors. The kernels are Python functions (transformers', FLA's) whose intermediates a custom op cannot keep
for its backward; the op's backward therefore recomputes the call and differentiates it: a compiled mixer keeps
only its inputs for the backward and runs its forward twice (docs/DESIGN.md, "Recurrent mixers").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, List, Optional

import torch

from . import recurrence

__all__ = ["run", "compiled"]


def run(kind: str, kernel: Callable, plan: recurrence.Plan, group, args: tuple, kwargs: dict):
    """``kernel(*args, **kwargs)`` (transformers' signature for its kind) over this rank's rows, exact."""
    if kind == "conv":
        return _conv(kernel, plan, group, *args, **kwargs)
    if kind == "delta":
        return recurrence.delta_rule(kernel, plan, group, *args, **kwargs)
    return recurrence.ssd(kernel, plan, group, *args, **kwargs)


def _conv(kernel, plan, group, conv1d, x, cache, layer_idx, activation=None, state_idx=0, **kwargs):
    """transformers' ``causal_conv1d_forward`` by halo exchange; in :func:`tokenring.hf.prefill` (``cache``) it
    also leaves the whole prompt's convolution state in the cache, on every rank."""
    kw = {k: v for k, v in kwargs.items() if k not in recurrence.PACKING_KWARGS}
    k = conv1d.kernel_size[0]

    def conv(y):
        return kernel(conv1d, y, None, layer_idx, activation=activation, state_idx=state_idx, **kw)

    if cache is None:
        return recurrence.causal_conv(conv, plan, group, x, k - 1)
    out, end = recurrence.causal_conv(conv, plan, group, x, k - 1, end=True)
    cache.set_conv_state(layer_idx, state_idx, torch.nn.functional.pad(end, (1, 0)), plan.length)
    return out


# How a compiled call's arguments travel: constants of the graph, with each tensor replaced by (_TENSOR, index into
# the op's tensors) and a Conv1d by (_CONV1D, weight, bias, kernel_size), its parameters being tensors
_TENSOR, _CONV1D = "tensor", "conv1d"


@dataclass(frozen=True)
class _Spec:
    """Everything of a compiled call but its tensors: the kernel, its arguments (tensors as slots), and where
    this rank's rows sit (``rows``: the tensor and dim that count them)."""

    kind: str
    kernel: Callable
    args: tuple
    kwargs: tuple
    rows: tuple
    P: int
    rank: int
    layout: str
    group: str


_specs: list[_Spec] = []
_ids: dict[tuple, int] = {}


def _split(value, tensors: list):
    """``value`` with its tensors moved into ``tensors`` and replaced by slots; ``None`` if a value cannot be a
    constant of the graph."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (_TENSOR, len(tensors) - 1)
    if isinstance(value, torch.nn.Conv1d):
        bias = _split(value.bias, tensors) if value.bias is not None else None
        return (_CONV1D, _split(value.weight, tensors), bias, tuple(value.kernel_size))
    if isinstance(value, (tuple, list)):
        parts = tuple(_split(v, tensors) for v in value)
        return None if any(p is None and v is not None for p, v in zip(parts, value)) else ("tuple", parts)
    return value if value is None or isinstance(value, (bool, int, float, str)) else None


def _filled(value, tensors):
    if not isinstance(value, tuple):
        return value
    if value[0] == _TENSOR:
        return tensors[value[1]]
    if value[0] == _CONV1D:
        _, weight, bias, size = value
        return SimpleNamespace(weight=_filled(weight, tensors), bias=_filled(bias, tensors), kernel_size=size)
    return tuple(_filled(v, tensors) for v in value[1])


def _rebuild(spec: _Spec, tensors) -> tuple[tuple, dict]:
    return _filled(spec.args, tensors), {k: _filled(v, tensors) for k, v in spec.kwargs}


def _constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing dynamo: dynamo runs ``fn`` while it traces
    (its arguments are constants) and puts the result in the graph."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_result
def _register(kind: str, module: str, name: str, args, kwargs, rows, P: int, rank: int, layout: str, group: str):
    """The number of the call with these constants (registered now, at tracing: a graph holds the number)."""
    key = (kind, module, name, args, kwargs, rows, P, rank, layout, group)
    if key not in _ids:
        kernel = getattr(sys.modules[module], name)
        kernel = getattr(kernel, "__tokenring_original__", kernel)
        _ids[key] = len(_specs)
        _specs.append(_Spec(kind, kernel, args, kwargs, rows, P, rank, layout, group))
    return _ids[key]


_ROWS = {"delta": (0, 1), "ssd": (0, 1), "conv": (1, -1)}  # (argument, dim) counting the rows: q, x, x


def compiled(kind: str, module: str, name: str, call, args: tuple, kwargs: dict):
    """The call of ``module.name`` through ``tokenring::mixer_kernel`` (``call``: the mixer's sharded forward,
    ``mixers._Call``), with the kernel's return structure; ``None`` if an argument cannot be a graph constant."""
    from .ops import _group_name

    kwargs = {k: v for k, v in kwargs.items() if k not in recurrence.PACKING_KWARGS}
    tensors: list = []
    sargs = _split(tuple(args), tensors)
    skw = tuple((k, _split(v, tensors)) for k, v in kwargs.items())
    if sargs is None or any(v is None and kwargs[k] is not None for k, v in skw):
        return None
    arg, dim = _ROWS[kind]
    rows = sargs[1][arg] if arg < len(sargs[1]) else None
    if not (isinstance(rows, tuple) and rows[0] == _TENSOR):
        return None
    number = _register(
        kind, module, name, sargs, skw, (rows[1], dim), call.P, call.rank, call.layout, _group_name(call.group)
    )
    outs = mixer_kernel(tensors, call.cu, number)
    return _structured(kind, _final_wanted(skw), outs)  # (not from _specs: the trace saw it before _register)


def _final_wanted(kwargs: tuple) -> bool:
    kw = dict(kwargs)
    return bool(kw.get("output_final_state", False) or kw.get("return_final_states", False))


def _structured(kind: str, final_wanted: bool, outs: list):
    """The op's outputs as the kernel returns them: conv ``out``; delta ``(o, final or None)``; ssd ``y`` or
    ``(y, final)``."""
    if kind == "conv":
        return outs[0]
    final = outs[1] if final_wanted else None
    if kind == "delta":
        return outs[0], final
    return (outs[0], final) if final is not None else outs[0]


def _flat(spec: _Spec, result) -> list[torch.Tensor]:
    """The kernel's return value as the op's list of outputs."""
    if spec.kind == "conv":
        return [result]
    if spec.kind == "delta":
        o, final = result
    else:
        o, final = result if isinstance(result, tuple) else (result, None)
    return [o, final] if _final_wanted(spec.kwargs) else [o]


def plan(rows: int, P: int, rank: int, layout: str, cu) -> recurrence.Plan:
    """The plan of this rank's ``rows`` (``cu``: the documents' starts, ``cu_seq_lens_q``, or ``None``)."""
    starts = tuple(int(x) for x in cu[:-1].tolist()) if cu is not None else (0,)
    return recurrence.plan_for(rows * P, P, rank, layout, starts)


def _plan(spec: _Spec, tensors, cu) -> recurrence.Plan:
    slot, dim = spec.rows
    return plan(tensors[slot].shape[dim], spec.P, spec.rank, spec.layout, cu)


def _sharded(spec: _Spec, tensors, cu) -> list[torch.Tensor]:
    from .ops import resolve_group

    args, kwargs = _rebuild(spec, tensors)
    result = run(spec.kind, spec.kernel, _plan(spec, tensors, cu), resolve_group(spec.group), args, kwargs)
    return _flat(spec, result)


@torch.library.custom_op("tokenring::mixer_kernel", mutates_args=())
def mixer_kernel(tensors: List[torch.Tensor], cu: Optional[torch.Tensor], spec: int) -> List[torch.Tensor]:
    """The registered call ``spec`` (its kernel and constant arguments) over this rank's rows ``tensors``;
    ``cu``: the documents' starts (``cu_seq_lens_q``) or ``None``."""
    outs = _sharded(_specs[spec], tensors, cu)
    return [o.clone() if any(o is t for t in tensors) else o.contiguous() for o in outs]  # as the fake says


@mixer_kernel.register_fake
def _(tensors, cu, spec):
    """The kernel run unsharded on the fake tensors gives the shapes and dtypes; a final state is kept in the
    precision state passing folds in (:func:`tokenring.recurrence._state`)."""
    s = _specs[spec]
    args, kwargs = _rebuild(s, tensors)
    outs = _flat(s, s.kernel(*args, **kwargs))
    if len(outs) > 1:
        outs[1] = recurrence._state(outs[1])
    return [_contiguous_like(o) for o in outs]


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """What the ops return: contiguous tensors (a graph's later views were traced on the fake's strides)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _with_autograd():
    """A guard that turns autograd back on inside a custom op's implementation (the dispatcher excludes it)."""
    C = torch._C
    excluded = C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "ADInplaceOrView", "AutogradOther"):
        excluded = excluded.remove(getattr(C.DispatchKey, key))
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), excluded)


@torch.library.custom_op("tokenring::mixer_kernel_backward", mutates_args=())
def mixer_kernel_backward(
    grads: List[torch.Tensor], tensors: List[torch.Tensor], cu: Optional[torch.Tensor], spec: int
) -> List[torch.Tensor]:
    """The gradients of :func:`mixer_kernel` for each of ``tensors`` (zeros where none flows), by recomputing
    the call: every rank runs the same exchanges again, in the same order."""
    with _with_autograd(), torch.enable_grad():
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
        outs = _sharded(_specs[spec], inputs, cu)
        wanted = [i for i in inputs if i.requires_grad]
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        res = [next(got) if i.requires_grad else None for i in inputs]
    return [
        torch.zeros(t.shape, dtype=t.dtype, device=t.device) if g is None else g.contiguous()
        for g, t in zip(res, tensors)
    ]


@mixer_kernel_backward.register_fake
def _(grads, tensors, cu, spec):
    return [_contiguous_like(t) for t in tensors]


def _setup(ctx, inputs, output):
    tensors, cu, spec = inputs
    ctx.save_for_backward(cu, *tensors)
    ctx.spec, ctx.outs = spec, [(o.shape, o.dtype, o.device) for o in output]


def _backward(ctx, grads):
    cu, *tensors = ctx.saved_tensors
    grads = [
        torch.zeros(o[0], dtype=o[1], device=o[2]) if g is None else g.contiguous() for g, o in zip(grads, ctx.outs)
    ]
    return mixer_kernel_backward(grads, tensors, cu, ctx.spec), None, None


mixer_kernel.register_autograd(_backward, setup_context=_setup)
