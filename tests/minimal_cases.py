"""Rank side of tests/test_minimal.py: examples/token_ring_minimal.py against tokenring.attention."""

from __future__ import annotations

import os
import sys

import torch

import tokenring

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")


def minimal_vs_library(rank: int, P: int, causal: bool, s: int, H: int, d: int) -> float:
    """The largest difference between the minimal example and the library (out, dq, dk, dv), float64."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from token_ring_minimal import TokenRingAttention

    g = torch.Generator().manual_seed(1234)
    full = [torch.randn(2, s * P, H, d, generator=g, dtype=torch.float64) for _ in range(4)]
    q, k, v, do = (x[:, rank * s : (rank + 1) * s].clone() for x in full)
    results = []
    for run in ("minimal", "library"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if run == "minimal":
            out = TokenRingAttention.apply(*leaves, causal)
        else:
            out = tokenring.attention(*leaves, causal=causal, layout="contiguous", strategy="token_ring:direct,c=1,k=1")
        out.backward(do)
        results.append([out.detach()] + [t.grad for t in leaves])
    return max((a - b).abs().max().item() for a, b in zip(*results))
