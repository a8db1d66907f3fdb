"""TRL's trainers over a data x sequence parallel mesh: :class:`SequenceParallelSFTTrainer` and
:class:`SequenceParallelDPOTrainer` (``pip install trl``; usage, and what is refused: docs/hf.md).

SFT: each batch is sharded over the ``cp`` ranks (labels shifted on the full sequences first) and TRL's own loss,
a sum of per-token log-probabilities over a global count, runs on each rank's share; its metrics are sums over
the ranks, which hold disjoint targets. DPO: the per-sequence log-probabilities are sums over tokens, which a rank
holds only a share of, so each sharded forward's per-token outputs are gathered over the ``cp`` group (the
gradient flows back to each rank's share) and TRL's own loss and metrics then run on the whole sequences.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_model, recursively_apply, set_seed

try:
    import trl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tokenring.hf.trl needs TRL: pip install 'tokenring-attn[trl]'") from e

from ..device import collective_device
from ..layouts import AUTO_LAYOUT, DOCUMENT_LAYOUTS, group_info, local_positions
from ..mixers import _Gather, prepare
from .attention import _context
from .config import NAME
from .generate import prefill
from .trainer import SequenceParallelTrainer, dp_parts

__all__ = ["SequenceParallelSFTTrainer", "SequenceParallelDPOTrainer", "SequenceParallelGRPOTrainer"]


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

    def __init__(self, model, sp, who: str = "SequenceParallelDPOTrainer"):
        self.model, self.sp, self.who = model, sp, who
        self._plans: dict = {}

    def __call__(self, input_ids, labels, attention_mask=None, fused_lm_head=False, use_cache=False, **extra):
        if not fused_lm_head or extra:
            raise ValueError(
                f"{self.who}: only TRL's fused log-probabilities are computed over the sharded "
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
        if sp.layout in (*DOCUMENT_LAYOUTS, AUTO_LAYOUT):
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


class SequenceParallelGRPOTrainer(SequenceParallelTrainer, trl.GRPOTrainer):
    """A :class:`trl.GRPOTrainer` whose rollouts and steps run over ``sp`` (:class:`tokenring.hf.SequenceParallel`).

    Each dp rank's prompts are prefilled sharded over its ``cp`` ranks and decoded over the sharded KV cache, the
    ranks agreeing on every sampled token (vLLM's or a ``rollout_func``'s rollouts: those of the cp group's rank 0,
    sent to the others); the policy, old-policy and reference log-probabilities run sharded and
    are gathered per token (never the logits), so TRL's own rewards, advantages, every ``loss_type`` and its
    metrics run unchanged, over the dp ranks as the processes. ``generation_batch_size`` counts dp ranks."""

    _scales_its_loss = True  # GRPO normalises by its own global token counts and gradient accumulation

    def __init__(self, sp, *args, **kwargs):
        who = "SequenceParallelGRPOTrainer"
        config = _bound(trl.GRPOTrainer.__init__, args, kwargs).get("args")
        if "tiled_loss" in kwargs:
            raise ValueError(f"{who}: tiled_loss is not needed: TRL's fused LM head never forms the logits")
        if sp.world_size > 1 and config is None:
            raise ValueError(f"{who}: pass args=GRPOConfig(...): the generation batch is set from it per dp rank")
        if config is not None:
            _check_grpo_config(config, sp, who)
        if sp.layout in (*DOCUMENT_LAYOUTS, AUTO_LAYOUT):
            raise ValueError(
                f"{who}: layout={sp.layout!r} does not take the padding of GRPO's prompt/completion rows; use "
                f"SequenceParallel(mesh, layout='zigzag') or 'contiguous'"
            )
        super().__init__(sp, *args, **kwargs)
        _refuse_common(self, who, {"model": self.model, "reference model": self.ref_model})
        for f in self.reward_funcs:
            if getattr(getattr(f, "config", None), "_attn_implementation", None) == NAME and sp.cp_size > 1:
                raise ValueError(
                    f"{who}: reward model {type(f).__name__} runs attention with {NAME!r}, but reward models score "
                    f"whole sequences on every rank; build it with attn_implementation='sdpa' (or 'eager')"
                )
        if self.ref_model is not None:
            prepare(self.ref_model, _context, sp.cp_size, who)
        if sp.world_size > 1:  # set_seed(device_specific=True) over the dp ranks: a cp group samples alike
            set_seed(self.args.seed + sp.dp_rank)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        if self.sp.cp_size == 1:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        model = self.accelerator.unwrap_model(self.model_wrapped)  # what TRL's generation unwraps
        model.generate = _ShardedGenerate(model, self.sp)
        try:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        finally:
            del model.generate

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self.sp.cp_size > 1 and (self.use_vllm or self.rollout_func is not None):
            # vLLM (or a custom rollout) sampled on each rank apart: the cp group trains on its rank 0's rollouts
            box = [out]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.sp.cp, 0), group=self.sp.cp)
            out = box[0]
        return out

    def _generate_and_score_completions(self, inputs):
        with _over_dp(self):
            return super()._generate_and_score_completions(inputs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        # policy, old policy and reference (TRL disables a PEFT adapter around this call): sharded, gathered
        sharded = _ShardedFused(model, self.sp, "SequenceParallelGRPOTrainer")
        return super()._get_per_token_logps_and_entropies(sharded, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # every cp rank computes its dp rank's loss on the gathered log-probabilities; the gather's backward sums
        # the cp ranks' gradients, so DDP's average over all W ranks is the dp average of one process's gradients
        with _over_dp(self):
            return trl.GRPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return trl.GRPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)


def _check_grpo_config(config, sp, who: str) -> None:
    """Refuse what cannot be made exact, and count the generation batch over the dp ranks (GRPOConfig counts
    every process; a cp group shares one dp rank's rollouts)."""
    if sp.cp_size > 1 and config.use_transformers_continuous_batching:
        raise ValueError(
            f"{who}: use_transformers_continuous_batching (generate_batch) does not take a sharded KV cache; leave "
            f"it False (model.generate over the sharded cache)"
        )
    if config.entropy_coef != 0 or config.use_adaptive_entropy:
        raise ValueError(
            f"{who}: an entropy bonus (entropy_coef={config.entropy_coef}, use_adaptive_entropy="
            f"{config.use_adaptive_entropy}) is not supported: the per-token entropies are gathered without their "
            f"gradient. Set entropy_coef=0"
        )
    if sp.cp_size == 1:
        return
    b, G = config.per_device_train_batch_size, config.num_generations
    config.generation_batch_size = b * sp.dp_size * config.steps_per_generation
    if config.generation_batch_size % G:
        raise ValueError(
            f"{who}: the generation batch, per_device_train_batch_size ({b}) x dp ranks ({sp.dp_size}) x "
            f"steps_per_generation ({config.steps_per_generation}), must be divisible by num_generations ({G})"
        )
    G_eval = config.num_generations_eval or G
    if config.do_eval and config.eval_strategy != "no" and (config.per_device_eval_batch_size * sp.dp_size) % G_eval:
        raise ValueError(
            f"{who}: the eval batch, per_device_eval_batch_size ({config.per_device_eval_batch_size}) x dp ranks "
            f"({sp.dp_size}), must be divisible by the number of generations ({G_eval})"
        )


class _ShardedGenerate:
    """``model.generate`` on the full left-padded prompts of a cp group: prefilled sharded, decoded over the
    sharded cache (every rank ends with the same tokens)."""

    def __init__(self, model, sp):
        self.model, self.sp = model, sp

    def __call__(self, input_ids, attention_mask=None, generation_config=None, **extra):
        if extra:
            raise ValueError(
                f"SequenceParallelGRPOTrainer: generation with {sorted(extra)} (multimodal inputs) is not supported"
            )
        cache = prefill(self.model, input_ids, attention_mask=attention_mask, group=self.sp.cp, layout=self.sp.layout)
        return type(self.model).generate(
            self.model, input_ids, attention_mask=attention_mask, generation_config=generation_config, cache=cache
        )


class _OverDataParallel:
    """The trainer's accelerator as GRPO's scoring, metrics and loss see it under ``cp``: the dp ranks are the
    processes. A cp group holds one dp rank's rollouts, so a gather over every rank would count each row cp times
    (sums, standard deviations and quantiles off, a prompt's generations split into wrong groups)."""

    def __init__(self, accelerator, sp):
        self._accelerator, self._sp = accelerator, sp
        self.process_index, self.num_processes = sp.dp_rank, sp.dp_size

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def gather(self, data):
        return recursively_apply(self._gather_one, data)

    def gather_for_metrics(self, data, use_gather_object: bool = False):
        return self.gather_object(data) if use_gather_object else self.gather(data)

    def _gather_one(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(dp_parts(t[None] if t.dim() == 0 else t, self._sp))

    def gather_object(self, obj):
        if self._sp.dp_size == 1:
            return obj
        out = [None] * self._sp.dp_size
        dist.all_gather_object(out, obj, group=self._sp.dp)
        return [x for part in out for x in part]

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        def one(t):
            total = t.clone()
            if self._sp.dp_size > 1:
                device = collective_device(self._sp.dp)
                moved = total.to(device)
                dist.all_reduce(moved, group=self._sp.dp)
                total = moved.to(t.device)
            if reduction == "mean":
                total = total / self._sp.dp_size
            return total * scale

        return recursively_apply(one, tensor)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        size = torch.tensor([tensor.shape[dim]])
        longest = int(self._gather_one(size).max())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        fill = tensor.new_full(shape, pad_index)
        return torch.cat([fill, tensor] if pad_first else [tensor, fill], dim=dim)


@contextlib.contextmanager
def _over_dp(trainer):
    """Inside: ``trainer.accelerator`` and the module-level gathers GRPO calls see the dp ranks only."""
    if trainer.sp.cp_size == 1:
        yield
        return
    from trl.trainer import grpo_trainer

    accelerator, saved = trainer.accelerator, (grpo_trainer.gather, grpo_trainer.gather_object)
    view = _OverDataParallel(accelerator, trainer.sp)
    trainer.accelerator, grpo_trainer.gather, grpo_trainer.gather_object = view, view.gather, view.gather_object
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        grpo_trainer.gather, grpo_trainer.gather_object = saved
