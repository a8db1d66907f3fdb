"""Local block attention: ``(q_block, kv_block) -> (out, lse)`` and its backward, behind one interface
(:class:`~tokenring.kernels.base.Backend`) with one registry.

``REGISTRY`` lists the backends in order of preference; ``backend="auto"`` takes the first whose
:meth:`~tokenring.kernels.base.Backend.supports` accepts the block (the math path accepts every block). The
backward picks anew: on CPU the fused backward runs only for the dtypes this CPU runs it fast in
(:func:`cpu_backward_choice`). The backward takes ``delta = rowsum(dO * O)``, which is what the strategies ship
with a visiting query block; fused kernels, which form ``delta`` from ``O`` themselves, get an equivalent
``O'`` (:func:`out_for_delta`) when the real output is not at hand.

Adding a backend (FlashAttention-3, FlexAttention, ...): a module here with a ``Backend`` subclass (``supports``,
``forward``, ``backward``; ``gqa`` if it takes fewer K/V heads than query heads), and its instance in
``REGISTRY`` ahead of the ones it should beat. FlexAttention in torch 2.13 runs its forward on CPU (unfused,
without ``torch.compile``) but refuses a backward there, so its ``supports`` would say ``backward=False`` on
CPU and the math path would take the backward.
"""

from __future__ import annotations

import torch

from ..device import pretended
from ..merge import acc_dtype
from .base import Backend, out_for_delta
from .cpu import CpuFlash, cpu_backward_choice
from .cuda import CUDNN_MIN_CAPABILITY, Cuda, cuda_kernel, cuda_op
from .inputs import attention_inputs, fold_scale, softmax_scale_of, value_dim_apart
from .reference import Math, math_backward, math_forward

__all__ = [
    "block_forward",
    "block_backward",
    "tiled_forward",
    "tiled_backward",
    "math_forward",
    "math_backward",
    "out_for_delta",
    "cpu_backward_choice",
    "needs_equal_heads",
    "cuda_kernel",
    "pick",
    "REGISTRY",
    "BACKENDS",
    "Backend",
    "softmax_scale_of",
    "value_dim_apart",
    "attention_inputs",
    "fold_scale",
    "CUDNN_MIN_CAPABILITY",
]

REGISTRY: dict[str, Backend] = {b.name: b for b in (CpuFlash(), Cuda(), Math())}
BACKENDS = ("auto", *REGISTRY)


def pick(q: torch.Tensor, backend: str = "auto", mask: torch.Tensor | None = None, backward: bool = False) -> Backend:
    """The backend that runs blocks like ``q``: ``backend`` itself where it takes them (else the math path: a
    named fused kernel that cannot take a boolean mask falls back), or for ``"auto"`` the first in
    ``REGISTRY`` that does."""
    if mask is None and isinstance(q, torch.Tensor):  # per block: decided once per kind of block
        cpu = backward and q.device.type == "cpu"  # (the CPU backward follows a setting)
        key = (
            q.device,
            q.dtype,
            q.shape[-1],
            backend,
            backward,
            pretended(),
            cpu and cpu_backward_choice(q.dtype, q.shape[-1]),
        )
        hit = _picked.get(key)
        if hit is None:
            hit = _picked[key] = _pick(q, backend, None, backward)
        return hit
    return _pick(q, backend, mask, backward)


_picked: dict = {}


def _pick(q, backend: str, mask, backward: bool) -> Backend:
    if backend != "auto":
        if backend not in REGISTRY:
            raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
        named = REGISTRY[backend]
        return named if mask is None or named.supports(q, mask, False) else REGISTRY["math"]
    return next(b for b in REGISTRY.values() if b.supports(q, mask, backward))


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str = "auto",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one Q block over one K/V block. Returns ``(out (B,n,H,d) q.dtype, lse (B,H,n) acc)``.
    ``mask``: optional (n, m) bool, True where a query sees a key (rows that see none get out 0, lse -inf)."""
    return pick(q, backend, mask).forward(q, k, v, causal, scale, mask)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the rows' *global* ``lse`` and ``delta = rowsum(dO * O)`` (both (B, H, n)).

    Returns ``dq`` (B, n, H, d) and ``dk``, ``dv`` (B, m, Hkv, d): in the accumulator dtype from the math
    path, in the input dtype from a fused kernel (callers add them into accumulator-dtype sums either way).
    ``out``: the rows' real output, when the caller has it (else a fused kernel gets :func:`out_for_delta`)."""
    which = pick(q, backend, mask, backward=True)
    o = out if out is not None or which.name == "math" else out_for_delta(dout, delta)
    return which.backward(dout, q, k, v, o, lse, delta, causal, scale, mask)


def needs_equal_heads(q: torch.Tensor, backend: str = "auto") -> bool:
    """Whether the kernel that runs ``q``'s blocks takes only K/V with as many heads as ``q`` (the CUDA
    memory-efficient op); then callers repeat a visiting K/V block's heads once, not the kernel per block."""
    which = pick(q, backend)
    return not which.gqa or (which.name == "cuda" and cuda_op(q) == "efficient")


def tiled_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles, mask_of, scale: float, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of a block cut into :class:`tokenring.masks.Tile` s (disjoint query rows): each tile's rows come
    from one kernel call; rows in no tile see no key (out 0, lse -inf). ``mask_of(tile)``: its bool mask."""
    B, n, H, d = q.shape
    o = torch.zeros(B, n, H, d, dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for t in tiles:
        ot, lt = block_forward(
            q[:, t.q0 : t.q1], k[:, t.k0 : t.k1], v[:, t.k0 : t.k1], t.kind == "causal", scale, backend, mask_of(t)
        )
        o[:, t.q0 : t.q1] = ot
        lse[:, :, t.q0 : t.q1] = lt
    return o, lse


def tiled_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    tiles,
    mask_of,
    scale: float,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` of a block cut into tiles (see :func:`tiled_forward`), in the accumulator dtype:
    dQ rows come from one tile each, dK/dV rows sum over the tiles that read them."""
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for t in tiles:
        rows, keys = slice(t.q0, t.q1), slice(t.k0, t.k1)
        g = block_backward(
            dout[:, rows],
            q[:, rows],
            k[:, keys],
            v[:, keys],
            lse[:, :, rows],
            delta[:, :, rows],
            t.kind == "causal",
            scale,
            backend,
            None if out is None else out[:, rows],
            mask_of(t),
        )
        dq[:, rows] += g[0]
        dk[:, keys] += g[1]
        dv[:, keys] += g[2]
    return dq, dk, dv
