"""Exact merge of partial attention results through their log-sum-exp, in the accumulator dtype (float32, or
float64 for float64 inputs); ``o`` (B, n, H, d), ``lse`` (B, H, n) (docs/internals.md, "Exact merge").
"""

from __future__ import annotations

import warnings

import torch

from . import settings
from .device import is_cuda, pretended

__all__ = [
    "acc_dtype", "new_accumulator", "merge_", "merge_eager_", "merge_seen_", "merge_stacked", "merge_sink_",
    "sink_grad", "join", "split",
]  # fmt: skip

# on CUDA the merge is one compiled kernel unless compile_merge is off or compiling fails (docs/internals.md)
_compile_failed = False
_compiled = None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype for inputs of ``dtype``: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_accumulator(B: int, n: int, H: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty accumulator for ``n`` rows: ``o = 0``, ``lse = -inf`` (no key seen yet)."""
    acc = acc_dtype(dtype)
    o = torch.zeros(B, n, H, d, dtype=acc, device=device)
    lse = torch.full((B, H, n), float("-inf"), dtype=acc, device=device)
    return o, lse


def join(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A partial ``(o, lse)`` as one (B, n, H, d + 1) tensor, ``lse`` beside each row's output (what travels
    home where both have one dtype: one tensor to send, none to pack)."""
    return torch.cat([o, lse.transpose(1, 2).unsqueeze(-1)], 3)


def split(j):
    """A joined partial (..., n, H, d + 1) as its ``(o (..., n, H, d), lse (..., H, n))`` views."""
    d = j.shape[-1] - 1
    return j.narrow(-1, 0, d), j.select(-1, d).transpose(-1, -2)


def merge_(
    acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, compiled: bool | None = None
) -> None:
    """In place: ``(acc_o, acc_lse) <- merge((acc_o, acc_lse), (o, lse))``, never NaN (``compiled``: the fused
    kernel; default on CUDA tensors only)."""
    global _compile_failed, _compiled
    if compiled if compiled is not None else (is_cuda(acc_o) and not _compile_failed and settings.get("compile_merge")):
        try:
            if pretended() is not None:  # meta tensors: the compiled kernel's eager twin, same arguments
                merge_eager_(acc_o, acc_lse, o, lse)
                return
            if _compiled is None:
                _compiled = torch.compile(merge_eager_, dynamic=True, fullgraph=True)
            _compiled(acc_o, acc_lse, o, lse)
            return
        except Exception as e:  # no compiler / backend on this machine: the eager ops are exact too
            if compiled:
                raise
            warnings.warn(f"tokenring: the compiled merge failed ({type(e).__name__}: {e}); using eager ops")
            _compile_failed = True
    merge_eager_(acc_o, acc_lse, o, lse)


def merge_eager_(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """:func:`merge_` as eager elementwise ops (the reference, and what torch.compile fuses)."""
    lse = lse.to(acc_lse.dtype)
    hi = torch.maximum(acc_lse, lse)
    lo = torch.minimum(acc_lse, lse)
    # A row with hi == -inf saw no key on either side; shift by 0 there so that exp(-inf - 0) = 0, not NaN.
    hi_safe = torch.where(torch.isneginf(hi), torch.zeros_like(hi), hi)
    new_lse = hi + torch.log1p(torch.exp(lo - hi_safe))
    new_safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    # Weights exp(lse_x - lse_new) <= 1, laid out (B, n, H, 1) to scale o.
    w_acc = torch.exp(acc_lse - new_safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - new_safe).transpose(1, 2).unsqueeze(-1)
    acc_o.mul_(w_acc).addcmul_(o.to(acc_o.dtype), w_new)  # no temporary for o * w_new
    acc_lse.copy_(new_lse)


def merge_seen_(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """:func:`merge_` for a partial whose every row saw a key (``lse`` finite: attention without a mask), in
    fewer ops: the new partial's weight ``sigmoid(lse - acc_lse)`` (1 while the accumulator is empty), a lerp
    toward it, and ``logaddexp``."""
    if lse.dtype != acc_lse.dtype:
        lse = lse.to(acc_lse.dtype)
    if o.dtype != acc_o.dtype:
        o = o.to(acc_o.dtype)
    w = (lse - acc_lse).sigmoid_()  # 1 while the accumulator is empty (acc_lse = -inf)
    acc_o.lerp_(o, w.transpose(1, 2).unsqueeze(-1))
    torch.logaddexp(acc_lse, lse, out=acc_lse)


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of ``n`` partials stacked on a first dimension, ``o`` (n, B, rows, H, d) and ``lse`` (n, B, H, rows),
    in one pass (five ops whatever ``n``): ``(o, lse)`` of the rows, never NaN (a row no partial saw: 0 and
    -inf)."""
    total = torch.logsumexp(lse, 0)  # -inf where no partial saw the row
    share = torch.exp(lse - total).nan_to_num_(0.0)  # each <= 1; -inf - -inf = NaN where no partial saw it
    return (o * share.transpose(-1, -2).unsqueeze(-1)).sum(0), total


def merge_sink_(acc_o: torch.Tensor, acc_lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """In place: merge attention sinks (``sinks`` (H,)) into finished rows, as a partial of output 0."""
    lse = sinks.to(acc_lse.dtype)[None, :, None].expand_as(acc_lse)
    merge_eager_(acc_o, acc_lse, acc_o.new_zeros(()).expand_as(acc_o), lse)


def sink_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from these rows: ``-sum_rows exp(sink - lse) * delta`` per head."""
    p = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    p = torch.where(torch.isneginf(lse), torch.zeros_like(p), p)  # a row with no key and a sink of -inf
    return -(p * delta.to(lse.dtype)).sum(dim=(0, 2))
