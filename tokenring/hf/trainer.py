"""``transformers.Trainer`` over a data x sequence parallel mesh (:class:`SequenceParallelTrainer`); what it
changes and why: docs/hf.md.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from .. import mixers
from .attention import _context
from .batch import tiled_loss
from .training import SequenceParallel

__all__ = ["SequenceParallelTrainer"]


class SequenceParallelTrainer(Trainer):
    """A :class:`transformers.Trainer` whose steps run over ``sp`` (``tiled_loss``: a chunk size for the loss)."""

    def __init__(self, sp: SequenceParallel, *args, tiled_loss: int | None = None, **kwargs):
        self.sp, self.tiled_loss = sp, tiled_loss
        super().__init__(*args, **kwargs)
        mixers.prepare(self.model, _context, sp.cp_size, "SequenceParallelTrainer")  # before the first step
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
        self.args.prediction_loss_only = True

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

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if inputs.get("labels") is None:
            raise ValueError(
                "SequenceParallelTrainer: evaluate/predict without labels is not supported (each rank holds a "
                "shard of the logits; this trainer reports the loss only). Pass labels, or run the model under "
                "tokenring.hf.shard_batch and gather the logits with tokenring.hf.gather_logits"
            )
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs).detach()
        # the loss is this rank's W-scaled share: the Trainer averages it over the W ranks
        return loss, None, None


def _reduces_grads(model) -> bool:
    """Whether ``model`` is wrapped (or sharded) by something that averages gradients over the ranks."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        FSDPModule = FullyShardedDataParallel = DistributedDataParallel
    return isinstance(model, (DistributedDataParallel, FSDPModule, FullyShardedDataParallel)) or type(
        model
    ).__name__ in ("DeepSpeedEngine",)
