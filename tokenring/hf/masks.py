"""Which attention masks the sharded layers can follow: shared by the training layers (hf/attention.py) and the
decode steps over a sharded cache (hf/cache.py), without either importing the other."""

from __future__ import annotations

import torch


def _mask_problem(attention_mask, allow_padding: bool = False) -> str | None:
    """What cannot be sharded about ``attention_mask`` (``None``: nothing). ``allow_padding``: a 2D padding mask
    passes here; whether it pads on the right, which causal layers never see, is checked on the whole batch."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        return (
            f"got an attention mask of type {type(attention_mask).__name__}; only full causal or full "
            f"bidirectional attention can be sharded (pass attention_mask=None)"
        )
    if attention_mask.dim() == 2 and (allow_padding or bool(attention_mask.to(torch.bool).all())):
        return None  # all ones means no padding
    return (
        f"got an attention mask of shape {tuple(attention_mask.shape)} that masks tokens (padding or a "
        f"custom mask). TokenRing computes exact full causal/bidirectional attention over the sharded sequence "
        f"and cannot express padding masks: pass unpadded sequences of one length with attention_mask=None"
    )
