"""Batches, logits and the loss of a sharded model: :func:`shard_batch` (full batch in, this rank's shard
out), :func:`gather_logits`, :func:`reduce_loss`, and the chunked loss of :func:`tiled_loss`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..layouts import AUTO_LAYOUT, DOCUMENT_LAYOUTS, gather, group_info, padded_length, resolve_layout, shard
from ..loss import chunked_cross_entropy
from .attention import _padding_problem
from .config import IGNORE_INDEX, _settings, active, same_batch

__all__ = ["shift_labels", "shard_batch", "gather_logits", "reduce_loss", "tiled_loss", "causal_lm_loss"]


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets on the *full* sequence: ``out[:, i] = labels[:, i + 1]``, last = ``ignore_index``."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    layout: str | None = None,
    group=None,
    ignore_index: int = IGNORE_INDEX,
    verify: bool = False,
    _scaled: bool = False,
) -> dict:
    """This rank's shard of a batch given as full ``(B, S)`` tensors (identical on every rank), ready for
    ``model(**batch)``: ids, global positions, targets and their global count (docs/hf.md)."""
    if active() is not None and not _scaled:
        raise ValueError(
            "tokenring.hf.shard_batch: a tokenring.hf.SequenceParallel is active; use its "
            "shard_batch (the loss is scaled there for DDP/FSDP's average over every rank)"
        )
    layout = layout or _settings.layout
    group = group if group is not None else _settings.group
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected the full (batch, seq) tensor")
    B, S = input_ids.shape
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(
                f"tokenring.hf.shard_batch: attention_mask {tuple(attention_mask.shape)} and input_ids {(B, S)} "
                f"differ in shape"
            )
        problem = _padding_problem(attention_mask)
        if problem is not None:
            raise ValueError(f"tokenring.hf.shard_batch: {problem}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
    if labels is not None and attention_mask is not None:
        live = (shift_labels(labels, ignore_index) != ignore_index) & (attention_mask == 0)
        if bool(live.any()):
            b, i = (int(x) for x in live.nonzero()[0])
            raise ValueError(
                f"tokenring.hf.shard_batch: pad position {i} of row {b} has a target (labels[{b}, {i + 1}] is not "
                f"{ignore_index}). Pads attend only to pads here, where transformers fills fully masked rows its "
                f"own way, so a loss on them would differ: set the labels after pads to {ignore_index} (with left "
                f"padding, that is each row's first real token too), or pad on the right"
            )
    if verify:
        same_batch(
            group if group is not None else dist.group.WORLD,
            [t for t in (input_ids, labels, position_ids) if t is not None],
        )
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    input_ids, labels, position_ids, attention_mask = _pad_length(
        input_ids, labels, position_ids, attention_mask, layout, group, ignore_index
    )
    docs = packing(position_ids) if not position_ids.is_meta else None  # (meta: tokenring.testing's CUDA tier)
    docs = docs if docs is not None and (len(docs) > 2 or layout in DOCUMENT_LAYOUTS) else None
    if layout == AUTO_LAYOUT:  # the layers resolve it alike, from the cu_seq_lens_q passed below
        layout = resolve_layout(layout, input_ids.shape[1], group_info(group)[1], docs)

    def cut(t):
        return shard(t, dim=1, layout=layout, group=group, cu_seqlens=docs if layout in DOCUMENT_LAYOUTS else None)

    out = dict(input_ids=cut(input_ids), position_ids=cut(position_ids), use_cache=False)
    if docs is not None:  # the layers take them as they are (and a document layout, which tokens ranks hold)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = torch.tensor(docs, dtype=torch.int32)
    if attention_mask is not None and not bool(attention_mask.to(torch.bool).all()):
        out["attention_mask"] = cut(attention_mask)  # checked by the layers
    if labels is not None:
        targets = shift_labels(labels, ignore_index)
        local = cut(targets).contiguous()
        out.update(
            labels=local, shift_labels=local, num_items_in_batch=(targets != ignore_index).sum().to(input_ids.device)
        )
    return out


def packing(position_ids: torch.Tensor) -> list[int]:
    """The documents (``cu_seqlens``) packed in a batch's full position ids, as transformers reads them: a new
    document wherever a position is not the previous one plus 1. Every row must pack alike."""
    starts = torch.diff(position_ids, dim=-1) != 1
    if bool((starts != starts[:1]).any()):
        raise ValueError(
            "tokenring.hf.shard_batch: the rows of this batch pack different documents (position_ids restart at "
            "different places); packed batches must share one packing (DataCollatorWithFlattening makes batch 1)"
        )
    S = position_ids.shape[-1]
    return [0] + (starts[0].nonzero().flatten() + 1).tolist() + [S]


def _pad_length(input_ids, labels, position_ids, attention_mask, layout: str, group, ignore_index: int):
    """A few pad tokens at the end, a document of their own without targets, so that any length splits."""
    P = group_info(group)[1]
    if layout == "zigzag_docs":
        return input_ids, labels, position_ids, attention_mask  # its documents must split: local_positions says so
    pad = padded_length(input_ids.shape[1], P, layout) - input_ids.shape[1]
    if not pad:
        return input_ids, labels, position_ids, attention_mask
    B = input_ids.shape[0]
    grow = lambda t, value: torch.nn.functional.pad(t, (0, pad), value=value)
    extra = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype).expand(B, pad)
    return (
        grow(input_ids, 0),
        grow(labels, ignore_index) if labels is not None else None,
        torch.cat([position_ids.expand(B, -1), extra], dim=1),
        grow(attention_mask, 0) if attention_mask is not None else None,
    )


def gather_logits(
    logits: torch.Tensor, layout: str | None = None, group=None, length: int | None = None, cu_seqlens=None
) -> torch.Tensor:
    """The full ``(B, S, V)`` logits on every rank (``length``: drop :func:`shard_batch`'s pad rows;
    ``cu_seqlens``: the batch's ``cu_seq_lens_q``, for a layout that places tokens by document)."""
    group = group if group is not None else _settings.group
    layout = resolve_layout(layout or _settings.layout, None, group_info(group)[1], cu_seqlens)  # (auto: as placed)
    full = gather(logits.detach(), 1, layout, group, cu_seqlens=cu_seqlens)
    return full if length is None else full[:, :length]


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of the ranks' loss shares: the global mean loss on every rank (detached)."""
    group = group if group is not None else _settings.group
    total = loss.detach().clone()
    if group_info(group)[1] > 1:
        dist.all_reduce(total, group=group)
    return total


@contextlib.contextmanager
def tiled_loss(model: torch.nn.Module, chunk: int = 2048):
    """Inside this block, ``model(**batch).loss`` runs the head and the loss ``chunk`` tokens at a time, never
    building the ``(tokens, vocab)`` logits (docs/hf.md)."""
    inner = getattr(model, "module", model)  # DDP and the like wrap the model
    if getattr(inner.config, "final_logit_softcapping", None):
        raise ValueError("tokenring.hf.tiled_loss: final logit soft-capping is not supported")
    head = inner.get_output_embeddings()
    real = head.forward  # with accelerate's hooks, if it put them there: the loss calls them per chunk
    own = head.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) to put back after
    old = inner.__dict__.get("_loss_function")
    loss_args: list[dict] = []  # set while the loss calls the head

    def forward(h):
        """The model's own call hands the hidden states on; the loss's call runs the chunked head and loss. The
        loss goes through the module's ``__call__`` so that hooks on the head run around it: FSDP2 with the head
        as its own unit gathers the weight there (and again for backward) and reduces its gradient after."""
        if not loss_args:
            return h
        return chunked_cross_entropy(h, real, **loss_args[-1])

    def loss_function(
        logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX, shift_labels=None, **kwargs
    ):
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss_args.append(
            dict(
                labels=shift_labels.to(logits.device),
                chunk=chunk,
                ignore_index=ignore_index,
                num_items=num_items_in_batch,
            )
        )
        try:
            return head(logits)
        finally:
            loss_args.pop()

    head.forward = forward
    inner.loss_function = loss_function
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
        if old is None:
            inner.__dict__.pop("_loss_function", None)
        else:
            inner.loss_function = old


def causal_lm_loss(model: torch.nn.Module, batch: dict, *, chunk: int = 2048) -> torch.Tensor:
    """``model(**batch).loss`` with the head and the loss tiled over ``chunk`` tokens (:func:`tiled_loss`)."""
    with tiled_loss(model, chunk):
        return model(**batch).loss
