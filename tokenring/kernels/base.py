"""The interface every kernel backend implements, and what the backends share.

A backend computes one block of attention, ``(q_block, kv_block) -> (out, lse)``, and its backward, on the
shapes of the flash-attn layout: ``q`` (B, n, H, d); ``k``, ``v`` (B, m, Hkv, d) with ``H % Hkv == 0``. The
forward returns ``out`` (B, n, H, d) in ``q.dtype`` and ``lse`` (B, H, n) in the accumulator dtype (float32,
float64 for float64 inputs); ``causal`` masks key ``j > i`` (top-left aligned); ``mask`` (n, m) bool, where
given, is True where a query sees a key (rows that see none: out 0, lse -inf). The backward gets the rows'
output (the real one, or :func:`out_for_delta`'s stand-in) and their global lse, and returns ``dq``, ``dk``,
``dv`` (in the input dtype or the accumulator dtype: callers add them into accumulator sums).

A new backend is one module with a :class:`Backend` subclass and one line in ``tokenring/kernels/__init__.py``'s
``REGISTRY``; :func:`tokenring.kernels.block_forward` then offers it to every strategy, and ``explain`` lists
it. Its :meth:`Backend.supports` says which blocks it takes (device, dtype, head dim, masks, backward).
"""

from __future__ import annotations

import torch

from ..merge import acc_dtype

__all__ = ["Backend", "out_for_delta", "additive"]


class Backend:
    """One way to run a block. ``gqa``: takes K/V with fewer heads than Q (else callers repeat a visiting
    block's K/V heads once: :func:`tokenring.kernels.needs_equal_heads`)."""

    name: str = ""
    gqa: bool = True

    def supports(self, q: torch.Tensor, mask: torch.Tensor | None, backward: bool) -> bool:
        """Whether this backend runs blocks like ``q`` (device, dtype, head dim), with ``mask`` if given, in
        the forward (``backward=False``) or the backward."""
        raise NotImplementedError

    def describe(self) -> str:
        """What it takes, for ``explain``."""
        return self.name

    def forward(self, q, k, v, causal: bool, scale: float, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(
        self, dout, q, k, v, out, lse, delta, causal: bool, scale: float, mask=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``out``: the rows' output or :func:`out_for_delta`'s stand-in; ``delta = rowsum(dO * O)``; a backend
        reads whichever of the two it needs."""
        raise NotImplementedError


def additive(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask as the additive float mask fused ops take (0 where visible, -inf elsewhere)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))


def out_for_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """An output ``O'`` (B, n, H, d) in ``dout.dtype`` with ``rowsum(dO * O') == delta`` (delta (B, H, n)).

    A fused backward kernel wants the rows' output ``O`` only to form ``delta = rowsum(dO * O)`` itself. A
    visiting query block travels with ``delta`` (one number per row and head) instead of ``O`` (``d`` numbers),
    so the kernel gets the multiple of ``dO`` that has exactly that row sum: ``O' = dO * delta / |dO|^2``,
    computed on ``dO`` scaled by its row maximum so that no square under- or overflows. Rows with ``dO = 0``
    get ``O' = 0`` (their gradient is 0 whatever ``delta`` is)."""
    acc = acc_dtype(dout.dtype)
    g = dout.to(acc)
    top = g.abs().amax(-1, keepdim=True)  # (B, n, H, 1)
    live = top > 0
    u = g / torch.where(live, top, torch.ones_like(top))  # entries in [-1, 1], max |u| = 1
    norm = (u * u).sum(-1, keepdim=True).clamp_min(1.0)  # >= 1 on live rows
    c = delta.to(acc).transpose(1, 2).unsqueeze(-1) / (top * norm).where(live, torch.ones_like(top))
    return (u * c.where(live, torch.zeros_like(c))).to(dout.dtype)
