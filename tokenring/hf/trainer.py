"""``transformers.Trainer`` over a data x sequence parallel mesh (:class:`SequenceParallelTrainer`); what it
changes and why: docs/hf.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from transformers import Trainer

from .. import mixers
from ..device import collective_device
from .attention import _context
from .batch import gather_logits, reduce_loss, tiled_loss
from .training import SequenceParallel

__all__ = ["SequenceParallelTrainer"]


def place_for(model) -> None:
    """Under ``layout="auto"``: place packed batches for ``model``'s attention layer (its config's heads, key/value
    heads and head dim), unless the ``layer`` setting was given (``tokenring.configure(layer=...)``)."""
    from .. import settings

    if settings.source("layer")[1] != "default":
        return
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    H = getattr(cfg, "num_attention_heads", None)
    if not isinstance(H, int) or H < 1:
        return
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 0) // H
    if isinstance(Hkv, int) and isinstance(d, int) and d > 0 and H % Hkv == 0:
        settings.configure(layer=(H, Hkv, d))


class SequenceParallelTrainer(Trainer):
    """A :class:`transformers.Trainer` whose steps run over ``sp`` (``tiled_loss``: a chunk size for the loss)."""

    _scales_its_loss = False  # a subclass that normalises its loss itself, past the Trainer's num_items_in_batch

    def __init__(self, sp: SequenceParallel, *args, tiled_loss: int | None = None, **kwargs):
        self.sp, self.tiled_loss = sp, tiled_loss
        super().__init__(*args, **kwargs)
        mixers.prepare(self.model, _context, sp.cp_size, "SequenceParallelTrainer")  # before the first step
        if sp.layout == "auto":  # place packed batches for this model's attention layer
            place_for(self.model)
        if self._scales_its_loss:  # (GRPO) the loss and its normalisation are the trainer's own, not the Trainer's
            return
        if not self.args.average_tokens_across_devices:
            raise ValueError(
                "SequenceParallelTrainer needs average_tokens_across_devices=True (the default): the "
                "loss of a sharded sequence is a share of a count over every rank"
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                "SequenceParallelTrainer: compute_loss_func is not supported: it would get this rank's logits "
                "with labels it shifts itself, but a sharded sequence's labels must be shifted on the whole "
                "sequence first. Fold the loss into the model, or use label_smoothing_factor"
            )
        if self.label_smoother is not None and self.tiled_loss:
            raise ValueError(
                "SequenceParallelTrainer: label_smoothing_factor with tiled_loss is not supported (the tiled loss "
                "never forms the logits the smoothing needs); use one or the other"
            )
        if not self.model_accepts_loss_kwargs:
            raise ValueError(
                "SequenceParallelTrainer needs a model whose forward takes num_items_in_batch "
                "(transformers' causal language models do)"
            )

    def train(self, *args, **kwargs):
        # undo the "prepared" mark an evaluate() before train() leaves, so train() wraps the model (docs/hf.md)
        if (
            self.accelerator.num_processes > 1
            and self.model_wrapped is self.model
            and getattr(self.model, "_is_accelerate_prepared", False)
        ):
            del self.model._is_accelerate_prepared
            models = getattr(self.accelerator, "_models", [])
            models[:] = [m for m in models if m is not self.model]
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.accelerator.num_processes > 1 and not _reduces_grads(model):
            raise ValueError(
                f"SequenceParallelTrainer: the model trains as a bare {type(model).__name__} on "
                f"{self.accelerator.num_processes} ranks, so no gradient would be reduced; the "
                f"loss is scaled for DDP/FSDP's average over every rank"
            )
        return super().training_step(model, inputs, num_items_in_batch)

    def get_cp_size(self) -> int:
        return self.sp.cp_size

    def _track_num_input_tokens(self, inputs):
        # every cp rank holds its dp rank's whole batch: the count gathered over all ranks has each token cp times
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.sp.cp_size

    def floating_point_ops(self, inputs) -> float:
        # this rank's share of its dp rank's batch: the Trainer sums the ranks' counts
        return super().floating_point_ops(inputs) / self.sp.cp_size

    def _get_dataloader(
        self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None
    ):
        loader = super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        if self.accelerator.num_processes == 1:
            return loader
        shard = getattr(loader, "batch_sampler", None)
        if shard is None or not hasattr(shard, "num_processes"):
            raise ValueError(
                f"SequenceParallelTrainer: cannot shard the {description} data loader over the dp "
                f"ranks only ({type(loader).__name__}); use a map-style dataset"
            )
        shard.num_processes, shard.process_index = self.sp.dp_size, self.sp.dp_rank  # the same on cp ranks
        return loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        labels = inputs.get("labels")
        n = num_items_in_batch  # the Trainer's global count over its accumulated batch (see get_cp_size)
        if labels is not None and n is None:  # evaluation: count this batch's targets over the dp ranks
            n = self.sp.count(labels)
        batch = self.sp.shard_batch(
            ids,
            labels=labels,
            position_ids=inputs.get("position_ids"),
            attention_mask=inputs.get("attention_mask"),
            num_items_in_batch=n if labels is not None else None,
        )
        if self.tiled_loss and labels is not None:
            with tiled_loss(model, self.tiled_loss):
                outputs = model(**batch)
        else:
            outputs = model(**batch)
        loss = outputs.loss
        if self.label_smoother is not None and labels is not None:
            # the stock smoothing over this rank's targets, divided by the same W-scaled count
            loss = self.label_smoother(
                outputs, batch["shift_labels"], shift_labels=False, num_items_in_batch=batch["num_items_in_batch"]
            )
        # W * (this rank's loss sum) / N: averaged over the W ranks, the global mean
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = self._gather_over_dp  # (the stock loop resets it when done)
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_dp(self, data):
        """What ``accelerator.gather_for_metrics`` gives over ``dp`` processes: every dp rank's rows once (its
        cp ranks hold the same ones), in dp order, without the samples that fill out the last batch."""
        b, dp = self.args.per_device_eval_batch_size, self.sp.dp_size
        state = self.accelerator.gradient_state
        last = state.end_of_dataloader and state.remainder > 0

        def gather(t):
            parts = dp_parts(t, self.sp)
            if last:  # rank r's real samples: the remainder's share past the ranks before it (rows per sample)
                real = [max(0, min(b, state.remainder - r * b)) for r in range(dp)]
                parts = [p[: -(-n * len(p) // b)] for p, n in zip(parts, real)]
            return torch.cat(parts)

        return recursively_apply(gather, data)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss of this dp rank's batch (its mean, as one process computes it for that batch), and with
        ``prediction_loss_only=False`` its full logits, gathered over cp in the caller's order."""
        inputs = self._prepare_inputs(inputs)
        ids, labels = inputs["input_ids"], inputs.get("labels")
        scored = self._without_fill(labels, inputs.get("position_ids"))
        batch = self.sp.shard_batch(
            ids,
            labels=scored,
            position_ids=inputs.get("position_ids"),
            attention_mask=inputs.get("attention_mask"),
            num_items_in_batch=None if scored is None else (scored[..., 1:] != -100).sum().clamp(min=1),
        )
        with torch.no_grad():
            outputs = model(**batch)
        loss = logits = None
        if scored is not None:
            loss = outputs.loss
            if self.label_smoother is not None:
                loss = self.label_smoother(
                    outputs, batch["shift_labels"], shift_labels=False, num_items_in_batch=batch["num_items_in_batch"]
                )
            # this rank's share, scaled by W: summed over cp and divided by W, this dp rank's batch mean
            loss = reduce_loss(loss.detach().float(), group=self.sp.cp) / self.sp.world_size
        if not prediction_loss_only:
            logits = gather_logits(outputs.logits, self.sp.layout, self.sp.cp, ids.shape[1], batch.get("cu_seq_lens_q"))
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels

    def _without_fill(self, labels, position_ids):
        """``labels`` with no targets in the samples accelerate repeats to even out the dp ranks' last batches
        (the ``remainder`` real samples come first, in dp order); a packed row's samples are its documents."""
        state = self.accelerator.gradient_state
        if labels is None or not state.end_of_dataloader or state.remainder <= 0:
            return labels
        b = self.args.per_device_eval_batch_size
        real = max(0, min(b, state.remainder - self.sp.dp_rank * b))
        packed = position_ids is not None and labels.shape[0] == 1 and b > 1
        if packed:  # DataCollatorWithFlattening: one row, a document per sample
            starts = (position_ids[0] == 0).nonzero().flatten().tolist()
            cut = starts[real] if real < len(starts) else labels.shape[1]
            labels = labels.clone()
            labels[:, cut:] = -100
        elif real < labels.shape[0]:
            labels = labels.clone()
            labels[real:] = -100
        return labels


def dp_parts(t: torch.Tensor, sp: SequenceParallel) -> list[torch.Tensor]:
    """Every dp rank's ``t`` (one shape on all), in dp order, on ``t``'s device; ``[t]`` without dp ranks."""
    if sp.dp_size == 1:
        return [t]
    device = collective_device(sp.dp)
    parts = [torch.empty_like(t, device=device) for _ in range(sp.dp_size)]
    dist.all_gather(parts, t.to(device).contiguous(), group=sp.dp)
    return [p.to(t.device) for p in parts]


def _reduces_grads(model) -> bool:
    """Whether ``model`` is wrapped (or sharded) by something that averages gradients over the ranks."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        FSDPModule = FullyShardedDataParallel = DistributedDataParallel
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule around DDP (torch_compile=True)
    return isinstance(model, (DistributedDataParallel, FSDPModule, FullyShardedDataParallel)) or type(
        model
    ).__name__ in ("DeepSpeedEngine",)
