"""A cross-entropy over this rank's tokens that never holds the whole ``(tokens, vocab)`` logits.

At long context the language-model head, not attention, sets the longest sequence that fits: a rank with
``s`` tokens and a vocabulary of ``V`` holds ``s * V`` logits, their log-softmax and their gradient (``s = 64K``,
``V = 128K``: 32 GiB each in float32). :func:`chunked_cross_entropy` runs the head and the loss on ``chunk``
tokens at a time, keeps only each chunk's input for backward, and recomputes that chunk's logits there
(activation checkpointing of the head, as DeepSpeed's ALST tiles it): at most one chunk's logits and their
gradient exist at once, and the result is the same loss and gradients as the unchunked one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy"]


def _chunk_loss(head, h: torch.Tensor, y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = head(h).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head,
    labels: torch.Tensor,
    *,
    chunk: int = 2048,
    ignore_index: int = -100,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum(cross_entropy(head(hidden), labels)) / num_items`` computed ``chunk`` tokens at a time.

    ``hidden``: (..., D) hidden states of this rank's tokens (e.g. the last hidden state, (B, s, D));
    ``head``: the output projection, a module or a callable ``(..., D) -> (..., V)`` (``model.lm_head``;
    called per chunk, so FSDP's hooks and a bias work); ``labels``: (...) targets, already shifted (the next
    token of each position; ``ignore_index`` where there is none). ``num_items``: the divisor (default: the
    targets here that are not ignored); pass the *global* count (``num_items_in_batch``) for a rank's share
    of the global mean, as :func:`tokenring.hf.shard_batch` gives it. Logits are taken in float32 per chunk
    (as transformers' loss does). Returns a 0-d tensor."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)}: labels must have the "
            f"hidden states' shape without the last (feature) dim"
        )
    if int(chunk) < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if num_items is None:
        num_items = (y != ignore_index).sum()
    total = h.new_zeros((), dtype=torch.float32)
    owner = getattr(head, "__self__", head)  # a module's bound forward: its parameters count too
    grad = torch.is_grad_enabled() and (
        h.requires_grad or any(p.requires_grad for p in getattr(owner, "parameters", lambda: [])())
    )
    for a in range(0, h.shape[0], chunk):
        hc, yc = h[a : a + chunk], y[a : a + chunk]
        if grad:  # keep only the chunk's input; its logits are made again in backward
            part = checkpoint(_chunk_loss, head, hc, yc, ignore_index, use_reentrant=False)
        else:
            part = _chunk_loss(head, hc, yc, ignore_index)
        total = total + part
    return total / num_items
