"""What every entry point does to its inputs first: the softmax scale, autocast, MLA's value head dim, and a
scale <= 0 folded into the queries.
"""

from __future__ import annotations

import math

import torch

from ..device import autocast_dtype

__all__ = ["softmax_scale_of", "value_dim_apart", "attention_inputs", "fold_scale"]


def softmax_scale_of(softmax_scale: float | None, d: int) -> float:
    """The scale the caller asked for (default ``d ** -0.5``); ValueError unless it is a finite number."""
    scale = float(softmax_scale) if softmax_scale is not None else d**-0.5
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return scale


def value_dim_apart(q, k, v, softmax_scale: float | None):
    """MLA (DeepSeek-V3, Kimi K2): a value head dim ``dv`` other than q/k's ``d``. Zero columns make the dims
    equal without changing a number: padding ``v`` (``dv < d``) adds output columns that are exactly 0, padding
    ``q`` and ``k`` (``dv > d``) adds 0 to every score. Returns ``(q, k, v, scale, dv)``, with the scale fixed
    at q/k's own ``d`` and ``dv`` the columns to keep (``None``: nothing was padded). Tensors whose other dims
    disagree pass through to the shape checks."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return q, k, v, softmax_scale, None
    d, dv = q.shape[-1], v.shape[-1]
    if dv == d or k.shape[-1] != d or k.shape[:3] != v.shape[:3]:
        return q, k, v, softmax_scale, None
    scale = softmax_scale if softmax_scale is not None else d**-0.5  # checked (on every rank) by the caller
    if dv < d:
        return q, k, torch.nn.functional.pad(v, (0, d - dv)), scale, dv
    pad = (0, dv - d)
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), v, scale, dv


def attention_inputs(q, k, v, softmax_scale: float | None):
    """What every entry point does first: under ``torch.autocast`` cast q, k, v to its dtype as
    ``scaled_dot_product_attention`` does (rotary embeddings leave q and k in float32 beside a bf16 v), then
    :func:`value_dim_apart`. Returns ``(q, k, v, scale, dv)``."""
    dt = autocast_dtype(q) if isinstance(q, torch.Tensor) else None
    if dt is not None:
        q, k, v = (t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    return value_dim_apart(q, k, v, softmax_scale)


def fold_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """A scale <= 0 folded into the queries (differentiably): the fused kernels mask causal blocks in a way that
    gives NaN at such scales (PyTorch's CPU flash op and SDPA alike), while ``(q * scale) k^T`` at scale 1 is
    the same attention. Positive scales pass untouched (no extra rounding)."""
    return (q * scale, 1.0) if scale <= 0 else (q, scale)
