"""The math path: row-chunked matmul + softmax in the accumulator dtype, on any device and dtype, with any mask.
Memory stays O(chunk * m), never (n * m). The reference, and the fallback for what no fused kernel takes.
"""

from __future__ import annotations

import torch

from ..merge import acc_dtype
from .base import Backend

__all__ = ["Math", "math_forward", "math_backward"]

# Upper bound on elements of one chunk's score tensor (16 MiB in float32).
_MATH_CHUNK_ELEMS = 1 << 22


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


def _scores(qc, kt, scale, causal, row0, mask=None):
    """Scaled scores (B, Hkv, g, c, m) of grouped query rows ``row0 + [0, c)`` against ``kt`` (B, Hkv, 1, d, m);
    ``mask`` (n, m) bool hides the pairs where it is False."""
    s = torch.matmul(qc, kt) * scale
    if mask is not None:
        s = s.masked_fill(~mask[row0 : row0 + s.shape[-2]], float("-inf"))
    if causal:
        c, m = s.shape[-2], s.shape[-1]
        rows = torch.arange(row0, row0 + c, device=s.device).unsqueeze(1)
        s = s.masked_fill(torch.arange(m, device=s.device) > rows, float("-inf"))
    return s


def math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-quality forward in the accumulator dtype, chunked over query rows (memory O(chunk * m))."""
    acc = acc_dtype(q.dtype)
    B, n, H, d = q.shape
    m, Hkv = k.shape[1], k.shape[2]
    qg = _grouped(q, Hkv).to(acc)
    kt = k.transpose(1, 2).unsqueeze(2).to(acc).transpose(-1, -2)  # (B, Hkv, 1, d, m)
    vg = v.transpose(1, 2).unsqueeze(2).to(acc)  # (B, Hkv, 1, m, d)
    out = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)  # (B, Hkv, g, n)
    step = _chunk_rows(q, m)
    for r0 in range(0, n, step):
        s = _scores(qg[..., r0 : r0 + step, :], kt, scale, causal, r0, mask)
        l = torch.logsumexp(s, dim=-1)
        # Rows with no key: lse = -inf, out = 0 (exp(s - 0) of all -inf is 0, never NaN).
        p = torch.exp(s - torch.where(torch.isneginf(l), torch.zeros_like(l), l).unsqueeze(-1))
        out[..., r0 : r0 + step, :] = torch.matmul(p, vg)
        lse[..., r0 : r0 + step] = l
    return _ungrouped(out).to(q.dtype), lse.reshape(B, H, n)


def math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward in the accumulator dtype (any device and dtype), chunked over query rows (memory
    O(chunk * m)); consumes ``delta`` directly."""
    acc = acc_dtype(q.dtype)
    B, n, H, d = q.shape
    m, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    qg = _grouped(q, Hkv).to(acc)
    dog = _grouped(dout, Hkv).to(acc)
    kg = k.transpose(1, 2).unsqueeze(2).to(acc)  # (B, Hkv, 1, m, d)
    vt = v.transpose(1, 2).unsqueeze(2).to(acc).transpose(-1, -2)  # (B, Hkv, 1, d, m)
    kt = kg.transpose(-1, -2)
    lse_g = lse.to(acc).view(B, Hkv, g, n)
    delta_g = delta.to(acc).view(B, Hkv, g, n)
    dq = torch.empty_like(qg)
    dk = torch.zeros(B, Hkv, m, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    step = _chunk_rows(q, m)
    for r0 in range(0, n, step):
        qc, doc = qg[..., r0 : r0 + step, :], dog[..., r0 : r0 + step, :]
        c = qc.shape[-2]
        p = torch.exp(_scores(qc, kt, scale, causal, r0, mask) - lse_g[..., r0 : r0 + step].unsqueeze(-1))
        ds = p * (torch.matmul(doc, vt) - delta_g[..., r0 : r0 + step].unsqueeze(-1))
        dq[..., r0 : r0 + step, :] = torch.matmul(ds, kg) * scale
        # Sum over the g query heads sharing a K/V head by folding them into the row dimension.
        p2, ds2 = p.reshape(B, Hkv, g * c, m), ds.reshape(B, Hkv, g * c, m)
        dv += torch.matmul(p2.transpose(-1, -2), doc.reshape(B, Hkv, g * c, d))
        dk += torch.matmul(ds2.transpose(-1, -2), qc.reshape(B, Hkv, g * c, d)) * scale
    return _ungrouped(dq), dk.transpose(1, 2), dv.transpose(1, 2)


class Math(Backend):
    name = "math"

    def supports(self, q, mask, backward) -> bool:
        return True

    def describe(self) -> str:
        return "math: any device, dtype, head dim and mask (row-chunked, accumulator dtype)"

    def forward(self, q, k, v, causal, scale, mask=None):
        return math_forward(q, k, v, causal, scale, mask)

    def backward(self, dout, q, k, v, out, lse, delta, causal, scale, mask=None):
        return math_backward(dout, q, k, v, lse, delta, causal, scale, mask)
