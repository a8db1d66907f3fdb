"""PyTorch's CUDA attention ops: cuDNN on sm90+ (fp16/bf16, head dim a multiple of 8 up to 128), flash
(fp16/bf16 up to 256; both GQA-native) or memory-efficient (fp32, head dim a multiple of 4; equal heads: the
strategies repeat a visiting K/V block's heads once). float64, other head dims and boolean masks take the math
path. Each op's lse layout is normalised in :func:`_lse_from`.
"""

from __future__ import annotations

import torch

from ..device import gpu, is_cuda
from ..merge import acc_dtype
from .base import Backend

__all__ = ["Cuda", "cuda_kernel", "cuda_op", "CUDNN_MIN_CAPABILITY"]


# Which CUDA op runs a block, by dtype, head dim and compute capability. One H200, bf16, d=128 (the table shipped
# as tokenring/data/h200_sdpa.json): cuDNN runs 1.7-1.9x the flash op's TFLOP/s from 2K-token blocks up, forward
# and forward+backward, causal or not; the efficient op runs at about half of flash. So: cuDNN on sm90 and newer
# where it takes the head dim, flash on older GPUs and for head dims up to 256, the efficient op for fp32 (neither
# of the others takes it), the math path for everything else (float64, odd head dims).
CUDNN_MIN_CAPABILITY = (9, 0)


def cuda_kernel(dtype: torch.dtype, d: int, capability: tuple[int, int], nvidia: bool = True) -> str | None:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``None`` (math path) for blocks of ``dtype`` and head dim
    ``d`` on a GPU of compute ``capability`` (see the table above; no cuDNN unless ``nvidia``: ROCm has none)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if half and nvidia and d % 8 == 0 and d <= 128 and tuple(capability) >= CUDNN_MIN_CAPABILITY:
        return "cudnn"
    if half and d % 8 == 0 and d <= 256:
        return "flash"
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and d % 4 == 0:
        return "efficient"
    return None


def cuda_op(q: torch.Tensor) -> str | None:
    """:func:`cuda_kernel` for ``q``'s blocks on its GPU."""
    g = gpu(q.device)
    return cuda_kernel(q.dtype, q.shape[-1], g.capability, g.nvidia)


class Cuda(Backend):
    name = "cuda"

    def supports(self, q, mask, backward) -> bool:
        return is_cuda(q) and mask is None and cuda_op(q) is not None

    def describe(self) -> str:
        return "cuda: cuDNN (sm90+, fp16/bf16, d%8==0, d<=128), flash (fp16/bf16, d<=256), efficient (fp32, d%4==0)"

    def forward(self, q, k, v, causal, scale, mask=None):
        return _cuda_forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, delta, causal, scale, mask=None):
        return _cuda_backward(dout, q, k, v, out, lse.to(acc_dtype(q.dtype)).contiguous(), causal, scale)


def _cuda_forward(q, k, v, causal, scale):
    n, H = q.shape[1], q.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    op = cuda_op(q)
    if op == "cudnn":  # GQA-native
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
    elif op == "flash":  # GQA-native
        res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    else:  # equal heads only (callers repeat a visiting block's K/V heads once, see needs_equal_heads)
        kt, vt = _repeat_heads(kt, H), _repeat_heads(vt, H)
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, causal, scale=scale)
    return res[0].transpose(1, 2), _lse_from(op, res[1], n, acc_dtype(q.dtype))


def _lse_from(op: str, lse: torch.Tensor, n: int, acc: torch.dtype) -> torch.Tensor:
    """The one place each CUDA op's log-sum-exp becomes ours, (B, H, n) natural-log in ``acc``: flash gives
    (B, H, n); cuDNN (B, H, n, 1); the efficient op (B, H, ceil(n / 32) * 32), rows padded."""
    if op == "cudnn":
        lse = lse.squeeze(-1)
    elif op == "efficient":
        lse = lse[..., :n]
    return lse.to(acc).contiguous()


def _lse_for(op: str, lse: torch.Tensor) -> torch.Tensor:
    """Our (B, H, n) log-sum-exp in the layout op ``op``'s backward reads (the inverse of :func:`_lse_from`)."""
    if op == "cudnn":
        return lse.unsqueeze(-1)
    if op == "efficient":
        pad = -lse.shape[-1] % 32
        return torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    return lse


def _repeat_heads(k: torch.Tensor, H: int) -> torch.Tensor:
    """(B, H, m, d) from (B, Hkv, m, d): the fused CUDA ops take equal head counts."""
    return k if k.shape[1] == H else k.repeat_interleave(H // k.shape[1], dim=1)


def _sum_heads(dk: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B, Hkv, m, d) from per-query-head gradients (B, H, m, d): the query heads of a group share a K/V head."""
    B, H, m, d = dk.shape
    return dk if H == Hkv else dk.view(B, Hkv, H // Hkv, m, d).sum(2)


def _cuda_backward(dout, q, k, v, o, lse, causal, scale):
    n, m, H, Hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    # dO and O in one layout: cuDNN before 9.5.1 read dO with O's strides, and no op takes a 0 inner stride
    ot, dot = o.contiguous().transpose(1, 2), dout.contiguous().transpose(1, 2)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    op = cuda_op(q)
    lse = _lse_for(op, lse)
    # Dropout is 0: the random-state arguments are never read.
    seed = torch.empty((), dtype=torch.long, device=q.device)
    if op == "cudnn":  # GQA-native: dK/dV come back with the K/V's heads
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse, seed, seed, None, None, None, n, m, 0.0, causal, scale=scale
        )
    elif op == "flash":  # GQA-native
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse, None, None, n, m, 0.0, causal, seed, seed, scale=scale
        )[:3]
    else:  # the efficient op takes equal heads
        dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dot,
            qt,
            _repeat_heads(kt, H),
            _repeat_heads(vt, H),
            None,
            ot,
            lse,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )[:3]
        dk, dv = _sum_heads(dk, Hkv), _sum_heads(dv, Hkv)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
