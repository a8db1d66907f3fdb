"""TRL's trainers over a data x sequence parallel mesh: :class:`SequenceParallelSFTTrainer` and
:class:`SequenceParallelDPOTrainer` (``pip install trl``; usage, and what is refused: docs/hf.md).

SFT: each batch is sharded over the ``cp`` ranks (labels shifted on the full sequences first) and TRL's own loss,
a sum of per-token log-probabilities over a global count, runs on each rank's share; its metrics are sums over
the ranks, which hold disjoint targets. DPO: the per-sequence log-probabilities are sums over tokens, which a rank
holds only a share of, so each sharded forward's per-token outputs are gathered over the ``cp`` group (the
gradient flows back to each rank's share) and TRL's own loss and metrics then run on the whole sequences.
"""

from __future__ import annotations

import inspect

import torch
from accelerate.utils import is_peft_model

try:
    import trl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tokenring.hf.trl needs TRL: pip install 'tokenring-attn[trl]'") from e

from ..layouts import DOCUMENT_LAYOUTS, group_info, local_positions
from ..mixers import _Gather, prepare
from .attention import _context
from .config import NAME
from .trainer import SequenceParallelTrainer

__all__ = ["SequenceParallelSFTTrainer", "SequenceParallelDPOTrainer"]


def _bound(init, args, kwargs) -> dict:
    """The arguments a trainer's ``__init__`` receives, by name (positional ones included)."""
    return inspect.signature(init).bind_partial(None, *args, **kwargs).arguments


def _refuse_common(trainer, who: str, models: dict) -> None:
    """What neither trainer can shard exactly: models whose attention is not tokenring's, vision datasets, the
    MoE load-balancing loss."""
    if trainer.sp.cp_size > 1:
        for what, model in models.items():
            impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
            if model is not None and impl != NAME:
                raise ValueError(
                    f"{who}: the {what} runs attention with {impl!r}, which would see only this rank's shard of "
                    f"the sequence; build it with attn_implementation={NAME!r} (import tokenring.hf first)"
                )
    if getattr(trainer, "_is_vision_dataset", False):
        raise ValueError(f"{who}: vision datasets are not supported (images are not sharded along the sequence)")
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            f"{who}: the MoE load-balancing loss is not supported: it multiplies per-expert means over the batch's "
            f"tokens, so the ranks' shares do not add up to it. Set router_aux_loss_coef=0"
        )


def _count_tokens(trainer, inputs, before: int) -> None:
    """TRL's ``num_tokens`` metric counted on the full batches: each ``cp`` rank holds its dp rank's whole batch."""
    ids = inputs["input_ids"]
    if "attention_mask" in inputs:
        local = inputs["attention_mask"].sum()
    elif "position_ids" in inputs:
        local = torch.tensor(inputs["position_ids"].size(1), device=ids.device)
    else:
        local = torch.tensor(ids.numel(), device=ids.device)
    seen = trainer.accelerator.gather_for_metrics(local).sum().item() // trainer.sp.cp_size
    trainer._total_train_tokens = before + seen // trainer._tp_size
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


class SequenceParallelSFTTrainer(SequenceParallelTrainer, trl.SFTTrainer):
    """A :class:`trl.SFTTrainer` whose steps run over ``sp`` (:class:`tokenring.hf.SequenceParallel`): packing,
    padding-free batches, completion-only and assistant-only loss train as in one process."""

    def __init__(self, sp, *args, **kwargs):
        who = "SequenceParallelSFTTrainer"
        if "tiled_loss" in kwargs:
            raise ValueError(f"{who}: tiled_loss is not needed: TRL's fused LM head never forms the logits")
        super().__init__(sp, *args, **kwargs)
        if self.label_smoother is not None:
            raise ValueError(
                f"{who}: label_smoothing_factor is not supported: SFTTrainer smooths over labels it shifts itself, "
                f"but a sharded sequence's labels are shifted on the whole sequence first"
            )
        _refuse_common(self, who, {"model": self.model})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError("SequenceParallelSFTTrainer: a batch without labels (SFTTrainer's collators add them)")
        n = num_items_in_batch  # the Trainer's global count (see SequenceParallelTrainer.get_cp_size)
        if n is None:  # evaluation: this batch's targets over the dp ranks
            n = self.sp.count(labels).to(torch.float32)
        batch = self.sp.shard_batch(
            inputs["input_ids"],
            labels=labels,
            position_ids=inputs.get("position_ids"),
            attention_mask=inputs.get("attention_mask"),
            num_items_in_batch=n,
        )
        del batch["num_items_in_batch"]  # SFTTrainer divides by the global count and scales by the ranks itself
        before = self._total_train_tokens
        # W * (this rank's log-prob sum) / N: averaged over the W ranks by DDP, the global mean
        out = trl.SFTTrainer.compute_loss(self, model, batch, return_outputs, n)
        if self.model.training:
            _count_tokens(self, inputs, before)
        return out


class _ShardedFused:
    """A model with TRL's fused LM head, called on full ``(B, S)`` batches: it runs sharded over ``sp.cp`` and
    returns the per-token outputs of the whole sequences, on every rank (log-probabilities differentiable)."""

    def __init__(self, model, sp):
        self.model, self.sp = model, sp
        self._plans: dict = {}

    def __call__(self, input_ids, labels, attention_mask=None, fused_lm_head=False, use_cache=False, **extra):
        if not fused_lm_head or extra:
            raise ValueError(
                "SequenceParallelDPOTrainer: only TRL's fused log-probabilities are computed over the sharded "
                f"sequence (logits stay sharded); got fused_lm_head={fused_lm_head}, extra inputs {sorted(extra)}"
            )
        S = input_ids.shape[1]
        batch = self.sp.shard_batch(input_ids, labels=labels, attention_mask=attention_mask, num_items_in_batch=1.0)
        out = self.model(**batch, fused_lm_head=True)
        # shift_labels were given: position i scores token i + 1, and the last position has no target. TRL's
        # unshifted forward returns positions 0..S-2: keep those
        fields = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
        present = [f for f in fields if getattr(out, f) is not None]
        log_probs = self._gather(out.log_probs)[:, : S - 1]
        rest = {}
        if present:
            stacked = torch.stack([getattr(out, f).detach().float() for f in present], dim=-1)
            full = self._gather(stacked)[:, : S - 1]
            for i, f in enumerate(present):
                value = full[..., i]
                rest[f] = value.bool() if getattr(out, f).dtype == torch.bool else value.to(getattr(out, f).dtype)
        return type(out)(loss=None, log_probs=log_probs, aux_loss=None, **rest)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, s, ...) shards -> (B, s * P, ...) in natural order; the backward sums the ranks' gradients (every
        rank computes the same loss from the gathered values) and keeps this rank's rows."""
        rank, P = group_info(self.sp.cp)
        if P == 1:
            return x
        Sp, layout = x.shape[1] * P, self.sp.layout
        if Sp not in self._plans:
            held = torch.cat([local_positions(Sp, P, r, layout) for r in range(P)])
            self._plans[Sp] = (torch.argsort(held), local_positions(Sp, P, rank, layout))
        order, mine = self._plans[Sp]
        return _Gather.apply(x, self.sp.cp, order, mine)


class SequenceParallelDPOTrainer(SequenceParallelTrainer, trl.DPOTrainer):
    """A :class:`trl.DPOTrainer` whose steps run over ``sp`` (:class:`tokenring.hf.SequenceParallel`); the
    policy and the reference model both run sharded. Every DPO loss type trains as in one process."""

    def __init__(self, sp, *args, **kwargs):
        who = "SequenceParallelDPOTrainer"
        given = _bound(trl.DPOTrainer.__init__, args, kwargs)
        config = given.get("args")
        if "tiled_loss" in kwargs:
            raise ValueError(f"{who}: tiled_loss is not needed: TRL's fused LM head never forms the logits")
        if config is not None and config.precompute_ref_log_probs:
            raise ValueError(
                f"{who}: precompute_ref_log_probs=True is not supported: TRL precomputes them with a data loader "
                f"over every rank and an unsharded forward. Leave it False (the reference runs sharded each step)"
            )
        if given.get("ref_model") is None and (
            given.get("peft_config") is not None or is_peft_model(given.get("model"))
        ):
            raise ValueError(
                f"{who}: a PEFT model without ref_model is not supported (TRL computes the reference by disabling "
                f"the adapter inside its own forward, which is not sharded here); pass ref_model explicitly"
            )
        if sp.layout in DOCUMENT_LAYOUTS:
            raise ValueError(
                f"{who}: layout={sp.layout!r} does not take the padding of DPO's chosen/rejected rows; use "
                f"SequenceParallel(mesh, layout='zigzag') or 'contiguous'"
            )
        super().__init__(sp, *args, **kwargs)
        if self.ref_model is None:  # pragma: no cover - refused above
            raise ValueError(f"{who}: no reference model")
        _refuse_common(self, who, {"model": self.model, "reference model": self.ref_model})
        prepare(self.ref_model, _context, sp.cp_size, who)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(
                "SequenceParallelDPOTrainer: compute_metrics on logits is not supported (logits stay sharded); "
                "the DPO metrics are logged without it"
            )
        ref, before = self.ref_model, self._total_train_tokens
        self.ref_model = _ShardedFused(ref, self.sp)
        try:
            # every cp rank computes its dp rank's loss on the gathered log-probabilities; the gather's backward
            # sums the cp ranks' gradients, so DDP's average over all W ranks is the global mean's gradient
            loss = trl.DPOTrainer.compute_loss(self, _ShardedFused(model, self.sp), inputs, False, num_items_in_batch)
        finally:
            self.ref_model = ref
        if self.model.training:
            _count_tokens(self, inputs, before)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # DPO batches have no labels; the loss of each dp rank's batch, the same on its cp ranks
        return trl.DPOTrainer.prediction_step(self, model, inputs, True, ignore_keys)
