"""Local block attention: ``(q_block, kv_block) -> (out, lse)`` and its backward, per backend.

Shapes (flash-attn layout): ``q`` (B, n, H, d); ``k``, ``v`` (B, m, Hkv, d) with ``H % Hkv == 0``.
Forward returns ``out`` (B, n, H, d) in ``q.dtype`` and ``lse`` (B, H, n) in the accumulator dtype (float32,
float64 for float64 inputs). ``causal`` masks key ``j > i`` (top-left aligned); every schedule only uses it on
square diagonal blocks, where every row sees at least one key.

Backends:
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (tiled, GQA-aware, returns lse) for the forward.
- CUDA: PyTorch's flash op (fp16/bf16) or memory-efficient op (fp32/fp64), both returning lse.
- math: row-chunked matmul + softmax in the accumulator dtype; any device and dtype; memory stays
  O(chunk * m), never (n * m). It is the backward everywhere because it consumes ``delta = rowsum(dO * O)``
  directly, which is what the strategies ship between ranks instead of ``O`` (a fused kernel would need ``O``).
"""
from __future__ import annotations

import torch

from .merge import acc_dtype

__all__ = ["block_forward", "block_backward", "math_forward", "BACKENDS"]

BACKENDS = ("auto", "cpu_flash", "cuda", "math")
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Upper bound on elements of one chunk's score tensor in the math path (16 MiB in float32).
_MATH_CHUNK_ELEMS = 1 << 22


def _pick(q: torch.Tensor, backend: str) -> str:
    if backend != "auto":
        return backend
    if q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES:
        return "cpu_flash"
    if q.device.type == "cuda":
        return "cuda"
    return "math"


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one Q block over one K/V block. Returns ``(out (B,n,H,d) q.dtype, lse (B,H,n) acc)``."""
    which = _pick(q, backend)
    if which == "cpu_flash":
        # The op takes (B, H, S, d); transposed views are accepted and it handles GQA itself.
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        return o.transpose(1, 2), lse.to(acc_dtype(q.dtype)).contiguous()
    if which == "cuda":
        return _cuda_forward(q, k, v, causal, scale)
    if which == "math":
        return math_forward(q, k, v, causal, scale)
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")


def _cuda_forward(q, k, v, causal, scale):
    n, H, Hkv = q.shape[1], q.shape[2], k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if Hkv != H:  # the fused ops below take equal head counts
        kt = kt.repeat_interleave(H // Hkv, dim=1)
        vt = vt.repeat_interleave(H // Hkv, dim=1)
    if q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, causal,
                                                                      scale=scale)
    o, lse = res[0], res[1][..., :n]  # the efficient op pads lse's row dim to a multiple of 32
    return o.transpose(1, 2), lse.to(acc_dtype(q.dtype)).contiguous()


def _grouped(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B, n, H, d) -> (B, Hkv, g, n, d): query heads grouped under the K/V head they share."""
    B, n, H, d = q.shape
    return q.view(B, n, Hkv, H // Hkv, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, g, n, d) -> (B, n, H, d)."""
    B, Hkv, g, n, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, n, Hkv * g, d)


def _chunk_rows(q: torch.Tensor, m: int) -> int:
    B, _, H, _ = q.shape
    return max(1, _MATH_CHUNK_ELEMS // max(1, B * H * m))


def _scores(qc, kt, scale, causal, row0):
    """Scaled scores (B, Hkv, g, c, m) of grouped query rows ``row0 + [0, c)`` against ``kt`` (B, Hkv, 1, d, m)."""
    s = torch.matmul(qc, kt) * scale
    if causal:
        c, m = s.shape[-2], s.shape[-1]
        rows = torch.arange(row0, row0 + c, device=s.device).unsqueeze(1)
        s = s.masked_fill(torch.arange(m, device=s.device) > rows, float("-inf"))
    return s


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-quality forward in the accumulator dtype, chunked over query rows (memory O(chunk * m))."""
    acc = acc_dtype(q.dtype)
    B, n, H, d = q.shape
    m, Hkv = k.shape[1], k.shape[2]
    qg = _grouped(q, Hkv).to(acc)
    kt = k.transpose(1, 2).unsqueeze(2).to(acc).transpose(-1, -2)  # (B, Hkv, 1, d, m)
    vg = v.transpose(1, 2).unsqueeze(2).to(acc)                    # (B, Hkv, 1, m, d)
    out = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)   # (B, Hkv, g, n)
    step = _chunk_rows(q, m)
    for r0 in range(0, n, step):
        s = _scores(qg[..., r0:r0 + step, :], kt, scale, causal, r0)
        l = torch.logsumexp(s, dim=-1)
        # Rows with no key: lse = -inf, out = 0 (exp(s - 0) of all -inf is 0, never NaN).
        p = torch.exp(s - torch.where(torch.isneginf(l), torch.zeros_like(l), l).unsqueeze(-1))
        out[..., r0:r0 + step, :] = torch.matmul(p, vg)
        lse[..., r0:r0 + step] = l
    return _ungrouped(out).to(q.dtype), lse.reshape(B, H, n)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the rows' *global* ``lse`` and ``delta = rowsum(dO * O)`` (both (B, H, n)).

    Returns ``dq`` (B, n, H, d) and ``dk``, ``dv`` (B, m, Hkv, d), all in the accumulator dtype, so that
    contributions of many blocks sum without rounding. Chunked over query rows: memory O(chunk * m).
    """
    acc = acc_dtype(q.dtype)
    B, n, H, d = q.shape
    m, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    qg = _grouped(q, Hkv).to(acc)
    dog = _grouped(dout, Hkv).to(acc)
    kg = k.transpose(1, 2).unsqueeze(2).to(acc)                    # (B, Hkv, 1, m, d)
    vt = v.transpose(1, 2).unsqueeze(2).to(acc).transpose(-1, -2)  # (B, Hkv, 1, d, m)
    kt = kg.transpose(-1, -2)
    lse_g = lse.to(acc).view(B, Hkv, g, n)
    delta_g = delta.to(acc).view(B, Hkv, g, n)
    dq = torch.empty_like(qg)
    dk = torch.zeros(B, Hkv, m, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    step = _chunk_rows(q, m)
    for r0 in range(0, n, step):
        qc, doc = qg[..., r0:r0 + step, :], dog[..., r0:r0 + step, :]
        c = qc.shape[-2]
        p = torch.exp(_scores(qc, kt, scale, causal, r0) - lse_g[..., r0:r0 + step].unsqueeze(-1))
        ds = p * (torch.matmul(doc, vt) - delta_g[..., r0:r0 + step].unsqueeze(-1))
        dq[..., r0:r0 + step, :] = torch.matmul(ds, kg) * scale
        # Sum over the g query heads sharing a K/V head by folding them into the row dimension.
        p2, ds2 = p.reshape(B, Hkv, g * c, m), ds.reshape(B, Hkv, g * c, m)
        dv += torch.matmul(p2.transpose(-1, -2), doc.reshape(B, Hkv, g * c, d))
        dk += torch.matmul(ds2.transpose(-1, -2), qc.reshape(B, Hkv, g * c, d)) * scale
    return _ungrouped(dq), dk.transpose(1, 2), dv.transpose(1, 2)
