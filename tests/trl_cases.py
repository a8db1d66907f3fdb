"""Rank-side functions for tests/test_trl.py: TRL's SFTTrainer and DPOTrainer over a (dp, cp) mesh
(SequenceParallelSFTTrainer, SequenceParallelDPOTrainer), and the stock trainers in one process (the reference,
run in the pytest process: a stock trainer in a rank process would see the distributed environment)."""

from __future__ import annotations

import tempfile

import hf_cases
import torch
import torch.distributed as dist
from train_cases import SMALL, _env, _expect_value_error, mesh_of

import tokenring.hf as thf
from tokenring.hf import SequenceParallel

EOS = 127  # "</s>"; pad is "0"


def tokenizer():
    """Word-level over "0".."126" split on spaces, with "</s>" = 127 as eos and "0" as pad (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(EOS)} | {"</s>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", eos_token="</s>")


def _ids(n: int, gen) -> list[int]:
    return torch.randint(1, EOS, (n,), generator=gen).tolist()


def sft_data(kind: str) -> list[dict]:
    """Pre-tokenized samples of lengths no 2P splits; ``completion``: with a prompt/completion mask;
    ``assistant``: with the assistant-token mask a chat template gives (two assistant turns each)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [37, 5, 90, 13]
    rows = [{"input_ids": _ids(n, gen)} for n in lengths]
    for row, n, p in zip(rows, lengths, [20, 2, 41, 6]):
        if kind == "completion":
            row["completion_mask"] = [0] * p + [1] * (n - p)
        if kind == "assistant":
            row["assistant_masks"] = (
                [0] * (p // 2) + [1] * (p - p // 2) + [0] * ((n - p) // 2) + [1] * ((n - p + 1) // 2)
            )
    return rows


def sft_config(kind: str, tmp: str, per_device: int):
    """``plain`` (right padding), ``completion`` (completion-only loss), ``assistant`` (assistant-only loss),
    ``packing`` (BFD packing: padding-free rows of packed documents), ``padding_free`` (the batch's samples as
    one row of documents)."""
    from trl import SFTConfig

    extra = {
        "plain": {},
        "completion": dict(completion_only_loss=True),
        "assistant": {},  # the assistant_masks column always applies
        "packing": dict(packing=True, max_length=48),
        "padding_free": dict(padding_free=True, max_length=None),
    }[kind]
    return SFTConfig(
        output_dir=tmp,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
        max_grad_norm=1e9,
        dataset_num_proc=None,
        bf16=False,
        **extra,
    )


class _Grab:
    """A TrainerCallback that keeps the gradients before the optimizer step."""

    def __new__(cls, model, seen):
        from transformers import TrainerCallback

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

        return Grab()


def _outcome(trainer, seen: dict) -> dict:
    train = next(h for h in trainer.state.log_history if "loss" in h)
    return dict(log=train, grads=seen)


def sft_run(kind: str, dp: int, sp=None) -> dict:
    """One SFT step: the stock SFTTrainer in one process on the global batch (``sp`` None), or
    SequenceParallelSFTTrainer over ``sp``. Returns the logged metrics and the gradients."""
    from datasets import Dataset
    from trl import SFTTrainer

    from tokenring.hf.trl import SequenceParallelSFTTrainer

    model = hf_cases.build("llama", "sdpa" if sp is None else "tokenring", **SMALL)
    seen = {}
    with tempfile.TemporaryDirectory() as tmp:
        per_device = 2 if sp is not None else 2 * dp
        kw = dict(
            model=model,
            args=sft_config(kind, tmp, per_device),
            train_dataset=Dataset.from_list(sft_data(kind)),
            processing_class=tokenizer(),
            callbacks=[_Grab(model, seen)],
        )
        trainer = SFTTrainer(**kw) if sp is None else SequenceParallelSFTTrainer(sp, **kw)
        trainer.train()
    return _outcome(trainer, seen)


def sft_step(rank: int, P: int, dp: int, kind: str) -> dict:
    _env(rank, P)
    sp = SequenceParallel(mesh_of(dp, P))
    try:
        out = sft_run(kind, dp, sp)
        return out if rank == 0 else {}
    finally:
        sp.close()
        thf.configure(group=dist.group.WORLD)


def dpo_data() -> list[dict]:
    """Text prompt/chosen/rejected (space-separated ids) whose pairs differ in length."""
    gen = torch.Generator().manual_seed(5)
    text = lambda n: " ".join(map(str, _ids(n, gen)))
    shapes = [(11, 7, 3), (4, 13, 9), (21, 2, 6), (9, 9, 14)]
    return [dict(prompt=text(p), chosen=" " + text(c), rejected=" " + text(r)) for p, c, r in shapes]


def dpo_config(tmp: str, per_device: int, loss: str):
    from trl import DPOConfig

    extra = {
        "sigmoid": {},
        "mix": dict(loss_type=["sigmoid", "ipo", "sft"], loss_weights=[1.0, 0.5, 0.3], ld_alpha=0.5),
        "weighted": dict(loss_type=["robust"], label_smoothing=0.1, use_weighting=True),
    }[loss]
    return DPOConfig(
        output_dir=tmp,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
        max_grad_norm=1e9,
        beta=0.5,
        bf16=False,
        **extra,
    )


def dpo_run(loss: str, dp: int, sp=None) -> dict:
    """One DPO step (after an evaluation on the same pairs): the stock DPOTrainer in one process on the global
    batch (``sp`` None), or SequenceParallelDPOTrainer over ``sp``; the reference model is a copy of the policy
    with perturbed weights, so the log-ratios are not zero."""
    from datasets import Dataset
    from trl import DPOTrainer

    from tokenring.hf.trl import SequenceParallelDPOTrainer

    attn = "sdpa" if sp is None else "tokenring"
    model = hf_cases.build("llama", attn, **SMALL)
    ref = hf_cases.build("llama", attn, seed=1, **SMALL)
    seen = {}
    with tempfile.TemporaryDirectory() as tmp:
        per_device = 2 if sp is not None else 2 * dp
        kw = dict(
            model=model,
            ref_model=ref,
            args=dpo_config(tmp, per_device, loss),
            train_dataset=Dataset.from_list(dpo_data()),
            processing_class=tokenizer(),
            callbacks=[_Grab(model, seen)],
        )
        trainer = DPOTrainer(**kw) if sp is None else SequenceParallelDPOTrainer(sp, **kw)
        evaluated = trainer.evaluate(eval_dataset=Dataset.from_list(dpo_data()))
        trainer.train()
    out = _outcome(trainer, seen)
    out["eval"] = evaluated
    return out


def dpo_step(rank: int, P: int, dp: int, loss: str) -> dict:
    _env(rank, P)
    sp = SequenceParallel(mesh_of(dp, P))
    try:
        out = dpo_run(loss, dp, sp)
        return out if rank == 0 else {}
    finally:
        sp.close()
        thf.configure(group=dist.group.WORLD)


def refused(rank: int, P: int) -> dict:
    """The ValueError each unsupported setting raises when the trainer is built (every rank)."""
    from datasets import Dataset
    from trl import DPOConfig, GRPOConfig, SFTConfig

    from tokenring.hf.trl import (
        SequenceParallelDPOTrainer,
        SequenceParallelGRPOTrainer,
        SequenceParallelSFTTrainer,
    )

    _env(rank, P)
    sp = SequenceParallel()
    got = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            common = dict(output_dir=tmp, report_to=[], use_cpu=True, max_steps=1)
            sft = Dataset.from_list(sft_data("plain"))
            dpo = Dataset.from_list(dpo_data())

            def sft_trainer(model, **args):
                return lambda: SequenceParallelSFTTrainer(
                    sp, model=model, args=SFTConfig(**common, **args), train_dataset=sft, processing_class=tokenizer()
                )

            def dpo_trainer(model, ref, **args):
                return lambda: SequenceParallelDPOTrainer(
                    sp,
                    model=model,
                    ref_model=ref,
                    args=DPOConfig(**common, **args),
                    train_dataset=dpo,
                    processing_class=tokenizer(),
                )

            tr = lambda: hf_cases.build("llama", "tokenring", **SMALL)
            got["smoothing"] = _expect_value_error(sft_trainer(tr(), label_smoothing_factor=0.1), "label smoothing")
            got["sdpa"] = _expect_value_error(sft_trainer(hf_cases.build("llama", "sdpa", **SMALL)), "sdpa model")
            got["precompute"] = _expect_value_error(
                dpo_trainer(tr(), tr(), precompute_ref_log_probs=True), "precompute_ref_log_probs"
            )
            got["ref_sdpa"] = _expect_value_error(
                dpo_trainer(tr(), hf_cases.build("llama", "sdpa", **SMALL)), "sdpa reference"
            )

            def grpo_trainer(model, on=sp, **args):
                config = GRPOConfig(**common, **{"per_device_train_batch_size": 2, "num_generations": 2, **args})
                return lambda: SequenceParallelGRPOTrainer(
                    on,
                    model=model,
                    reward_funcs=_reward([]),
                    args=config,
                    train_dataset=Dataset.from_list(grpo_data()),
                    processing_class=tokenizer(),
                )

            got["grpo_batching"] = _expect_value_error(
                grpo_trainer(tr(), use_transformers_continuous_batching=True), "continuous batching"
            )
            got["grpo_entropy"] = _expect_value_error(grpo_trainer(tr(), entropy_coef=0.01), "entropy bonus")
            got["grpo_sdpa"] = _expect_value_error(grpo_trainer(hf_cases.build("llama", "sdpa", **SMALL)), "sdpa")
            # GRPOConfig counts 2 processes (2 prompts' rows per generation); the cp ranks share one prompt's row
            got["grpo_groups"] = _expect_value_error(
                grpo_trainer(tr(), per_device_train_batch_size=1, generation_batch_size=2), "a split group"
            )
        return got
    finally:
        sp.close()
        thf.configure(group=dist.group.WORLD)


def sft_evaluate(kind: str, sp=None) -> float:
    """SFTTrainer.evaluate on 3 samples in batches of 2 per dp rank (a remainder batch): the stock trainer in
    one process (``sp`` None) or SequenceParallelSFTTrainer over ``sp``."""
    from datasets import Dataset
    from trl import SFTTrainer

    from tokenring.hf.trl import SequenceParallelSFTTrainer

    model = hf_cases.build("llama", "sdpa" if sp is None else "tokenring", **SMALL)
    data = Dataset.from_list(sft_data(kind))
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(model=model, args=sft_config(kind, tmp, 2), train_dataset=data, eval_dataset=data.select(range(3)))
        kw["processing_class"] = tokenizer()
        trainer = SFTTrainer(**kw) if sp is None else SequenceParallelSFTTrainer(sp, **kw)
        return trainer.evaluate()["eval_loss"]


def sft_evaluate_step(rank: int, P: int, dp: int, kind: str) -> float:
    _env(rank, P)
    sp = SequenceParallel(mesh_of(dp, P))
    try:
        return sft_evaluate(kind, sp)
    finally:
        sp.close()
        thf.configure(group=dist.group.WORLD)


def grpo_data() -> list[dict]:
    """Text prompts of lengths no 2P splits (left-padded against each other in a batch)."""
    gen = torch.Generator().manual_seed(7)
    return [dict(prompt=" ".join(map(str, _ids(n, gen)))) for n in (13, 6, 29, 9, 17, 4, 11, 23)]


GRPO_SETTINGS = {  # name -> GRPOConfig options
    "grpo": dict(loss_type="grpo"),
    "dapo_old": dict(loss_type="dapo", num_iterations=2),  # old log-probabilities, importance ratios clipped
    "dr_grpo_kl": dict(loss_type="dr_grpo", beta=0.1, scale_rewards="batch"),  # a reference model
    "bnpo_seq": dict(loss_type="bnpo", importance_sampling_level="sequence", num_iterations=2, beta=0.1),
    "cispo_accum": dict(loss_type="cispo", gradient_accumulation_steps=2, top_entropy_quantile=0.5),
    "sapo": dict(loss_type="sapo", num_iterations=2),
    # one prompt per batch: rollouts without left padding
    "luspo": dict(loss_type="luspo", mask_truncated_completions=True, per_device_train_batch_size=2),
    "vespo": dict(loss_type="vespo", num_iterations=2),
    "vllm": dict(loss_type="grpo"),  # the sharded run takes one process's rollouts from a stand-in for vLLM
}
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_correction=False)


class _FakeVLLM:
    """Stands in for TRL's VLLMGeneration: returns the rollouts one process generated, call by call (``script``),
    on the cp group's rank 0, and other tokens on its other ranks (as vLLM's own samples would differ)."""

    script: list = []
    first: bool = True

    def __init__(self, **kwargs):
        self.calls = 0

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler):
        completions = self.script[self.calls]
        self.calls += 1
        if not self.first:
            completions = [[t % 100 + 1 for t in c] for c in completions]
        return None, completions, [[[0.0]] * len(c) for c in completions], None


def _reward(seen: list):
    """A reward of the completion's text that varies within a prompt's group; keeps every completion seen."""

    def parity(completions, **kw):
        seen.extend(completions)
        return [sum(int(w) % 2 == 0 for w in c.split() if w.isdigit()) / (1 + len(c.split())) for c in completions]

    return parity


def grpo_model(path: str, family: str = "llama") -> None:
    """The small model GRPO starts from, saved at ``path`` (TRL builds the reference model from its path): the
    Llama of the other TRL tests, or a family of tests/family_cases.py."""
    import family_cases

    model = hf_cases.build("llama", "sdpa", **SMALL) if family == "llama" else family_cases.build(family, "sdpa")
    model.save_pretrained(path)


def grpo_run(setting: str, dp: int, path: str, sp=None, script=None) -> dict:
    """Two GRPO steps on the small Llama saved at ``path`` (:func:`grpo_model`): the stock
    GRPOTrainer (``sp`` None: one process, or a pure dp run on the rank processes) or SequenceParallelGRPOTrainer
    over ``sp``. Returns the logs, the gradients of the last step, the parameters after it, the completions and
    the rollouts' token ids (``script``: rollouts to take from a stand-in for vLLM instead of generating)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    from tokenring.hf.trl import SequenceParallelGRPOTrainer

    attn = "tokenring" if sp is not None and sp.cp_size > 1 else "sdpa"
    seen, completions = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
        args = GRPOConfig(
            output_dir=tmp,
            num_generations=2,
            max_completion_length=10,
            max_steps=2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            learning_rate=0.05,
            optim="sgd",
            seed=0,
            disable_tqdm=True,
            bf16=False,
            generation_kwargs=dict(top_k=40),
            **{"per_device_train_batch_size": 4, **GRPO_SETTINGS[setting]},
            **(VLLM if script is not None else {}),
        )
        kw = dict(
            model=model,
            reward_funcs=_reward(completions),
            args=args,
            train_dataset=Dataset.from_list(grpo_data()),
            processing_class=tokenizer(),
            callbacks=[_Grab(model, seen)],
        )
        saved = grpo_trainer.VLLMGeneration
        if script is not None:
            _FakeVLLM.script, _FakeVLLM.first = script, dist.get_rank(sp.cp) == 0
            grpo_trainer.VLLMGeneration = _FakeVLLM
        try:
            trainer = GRPOTrainer(**kw) if sp is None else SequenceParallelGRPOTrainer(sp, **kw)
        finally:
            grpo_trainer.VLLMGeneration = saved
        rollouts, generate = [], trainer._generate_single_turn

        def record(*args, **kwargs):
            out = generate(*args, **kwargs)
            rollouts.append(out[0])
            return out

        trainer._generate_single_turn = record
        # ``grpo`` at dp = 1: evaluate first (at dp > 1 the stock trainer would then train without DDP's gradient
        # average: evaluate() leaves the model marked prepared, which SequenceParallelTrainer.train undoes)
        evaluated = {}
        if setting == "grpo" and dp == 1:
            evaluated = trainer.evaluate(eval_dataset=Dataset.from_list(grpo_data()[:4]))
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(logs=logs, grads=seen, params=params, completions=completions, rollouts=rollouts, eval=evaluated)


def grpo_step(rank: int, P: int, dp: int, setting: str, path: str, script=None, stock: bool = False) -> dict:
    """SequenceParallelGRPOTrainer over a (dp, P // dp) mesh, or (``stock``) the stock trainer over P dp ranks."""
    _env(rank, P)
    if stock:
        out = grpo_run(setting, dp, path)
        return out if rank == 0 else {}
    sp = SequenceParallel(mesh_of(dp, P))
    try:
        out = grpo_run(setting, dp, path, sp, script)
        return out if rank == 0 else {}
    finally:
        sp.close()
        thf.configure(group=dist.group.WORLD)
