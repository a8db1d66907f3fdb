"""The Trainer differential harness (tests/test_trainer_matrix.py): the stock ``transformers.Trainer`` in one
process against ``SequenceParallelTrainer`` over a (dp, cp) mesh, feature by feature. Each run trains 3 steps,
evaluates on a set that leaves a remainder batch, predicts with and without labels, and records what a user
sees: the logged losses, grad norms and learning rates, the evaluation loss, the predictions, the tokens seen,
the callback events and the parameter updates (plain SGD: Adam's first steps turn float32 rounding in
near-zero gradients into updates of +-lr, which would hide a real difference)."""

from __future__ import annotations

import os
import shutil
import tempfile

import hf_cases
import torch

PER_DEVICE = 2  # samples per dp rank per step (the one-process run takes dp times as many)
STEPS = 3
EVAL_SAMPLES = 5  # with 2 per dp rank, a remainder batch at dp = 1 and 2
SMALL = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128,
)  # fmt: skip

# name -> TrainingArguments over the base ones, and the harness's own options:
#   data: "fixed" (32 tokens, default_data_collator), "pad" (DataCollatorForLanguageModeling, right padding) or
#   "flatten" (DataCollatorWithFlattening: padding-free packing), both over lengths that split over no 2P;
#   resume: stop after step 1's checkpoint and resume from it; sp: SequenceParallelTrainer's own keywords;
#   tol: relative tolerance (float32 1e-4); layout: SequenceParallel's (default zigzag).
FEATURES = {
    "plain": {},
    "label_smoothing": {"args": dict(label_smoothing_factor=0.1)},
    "accumulation": {"args": dict(gradient_accumulation_steps=2)},
    "clipping": {"args": dict(max_grad_norm=0.05, learning_rate=0.3)},  # (lr: updates well above rounding)
    "checkpointing": {"args": dict(gradient_checkpointing=True)},
    "bf16": {"args": dict(bf16=True), "tol": 3e-2},
    "scheduler": {"args": dict(lr_scheduler_type="cosine", warmup_steps=2)},
    "padding": {"data": "pad", "args": dict(include_num_input_tokens_seen="non_padding")},
    "packing": {"data": "flatten"},
    "packing_auto": {"data": "flatten", "layout": "auto"},  # layout="auto": each packed batch placed by the cost model
    "resume": {"resume": True},
    "tiled_loss": {"sp": dict(tiled_loss=16)},  # SequenceParallelTrainer's own option (the stock run: none)
    # packed batches of a different length every step: traced once more for dynamic shapes, not per length
    "compile": {"data": "flatten", "args": dict(torch_compile=True, torch_compile_backend="aot_eager")},
}

# what SequenceParallelTrainer refuses when it is built (on every rank), and a phrase of the ValueError
REFUSED = {
    "compute_loss_func": (
        {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: 0},
        "compute_loss_func",
    ),
    "per_device_token_average": ({"args": dict(average_tokens_across_devices=False)}, "average_tokens_across_devices"),
    "smoothing_with_tiled_loss": ({"args": dict(label_smoothing_factor=0.1), "tiled_loss": 16}, "tiled_loss"),
}


def _collator(data: str):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, default_data_collator

    if data == "flatten":
        return DataCollatorWithFlattening()
    if data == "pad":
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {str(i): i for i in range(SMALL["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
        return DataCollatorForLanguageModeling(PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0"), mlm=False)
    return default_data_collator


def _samples(n: int, data: str, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    if data == "fixed":
        ids = torch.randint(1, SMALL["vocab_size"], (n, 32), generator=gen)
        return [dict(input_ids=ids[i], labels=ids[i]) for i in range(n)]
    lengths = torch.randint(1, 50, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(1, SMALL["vocab_size"], (m,), generator=gen).tolist()} for m in lengths]


class Events:
    """A callback recording the events a user's callback sees, with the step they came at."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self):
                self.seen = []

            def on_step_end(self, args, state, control, **kw):
                self.seen.append(("step_end", state.global_step))

            def on_evaluate(self, args, state, control, metrics=None, **kw):
                self.seen.append(("evaluate", state.global_step, sorted(metrics)))

            def on_save(self, args, state, control, **kw):
                self.seen.append(("save", state.global_step))

            def on_train_end(self, args, state, control, **kw):
                self.seen.append(("train_end", state.global_step))

        return Recorder()


def run(feature: str, dp: int, sp=None, out: str | None = None) -> dict:
    """One run of ``feature``: the stock Trainer in this process (``sp`` None: the global batch of dp ranks per
    step), else SequenceParallelTrainer over ``sp``. What it returns is the same on every rank."""
    from transformers import Trainer, TrainingArguments

    import tokenring.hf as thf

    spec = FEATURES[feature]
    data = spec.get("data", "fixed")
    args = dict(spec.get("args", {}))
    accumulate = args.get("gradient_accumulation_steps", 1)
    train = _samples(STEPS * accumulate * dp * PER_DEVICE, data, seed=3)
    evals = _samples(EVAL_SAMPLES, data, seed=4)
    model = hf_cases.build("llama", "sdpa" if sp is None else "tokenring", **SMALL)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    events = Events()
    own = out is None
    out = out or tempfile.mkdtemp()
    try:
        base = dict(
            output_dir=out, per_device_train_batch_size=PER_DEVICE * (dp if sp is None else 1),
            per_device_eval_batch_size=PER_DEVICE, max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", learning_rate=1e-2, optim="sgd", seed=0, disable_tqdm=True, remove_unused_columns=False,
            include_num_input_tokens_seen=True, eval_strategy="steps", eval_steps=STEPS,
        )  # fmt: skip
        if spec.get("resume"):
            base.update(save_strategy="steps", save_steps=1)
        kw = dict(
            model=model,
            args=TrainingArguments(**{**base, **args}),
            train_dataset=train,
            eval_dataset=evals,
            data_collator=_collator(data),
            callbacks=[events],
        )
        trainer = Trainer(**kw) if sp is None else thf.SequenceParallelTrainer(sp, **kw, **spec.get("sp", {}))
        if spec.get("resume"):  # a first run stopped at step 1 (a fresh trainer, like a restarted job)
            first = kw | dict(model=hf_cases.build("llama", model.config._attn_implementation, **SMALL))
            first["args"] = TrainingArguments(**{**base, **args, "max_steps": 1})
            first["callbacks"] = []
            (Trainer(**first) if sp is None else thf.SequenceParallelTrainer(sp, **first, **spec.get("sp", {}))).train()
            trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
        else:
            trainer.train()
        preds = trainer.predict(evals)
        unlabeled = [{k: v for k, v in s.items() if k != "labels"} for s in evals]
        bare = trainer.predict(unlabeled) if data != "flatten" else None
    finally:
        if own:
            shutil.rmtree(out, ignore_errors=True)
    logs = trainer.state.log_history
    return dict(
        loss=[h["loss"] for h in logs if "loss" in h],
        grad_norm=[h["grad_norm"] for h in logs if "grad_norm" in h],
        lr=[h["learning_rate"] for h in logs if "learning_rate" in h],
        eval=[h["eval_loss"] for h in logs if "eval_loss" in h],
        predict_loss=preds.metrics["test_loss"],
        # packed rows are one row per batch: their predictions are compared through the loss only
        logits=None if data == "flatten" else torch.as_tensor(preds.predictions),
        label_ids=None if data == "flatten" else torch.as_tensor(preds.label_ids),
        bare=None if bare is None else torch.as_tensor(bare.predictions),
        tokens=trainer.state.num_input_tokens_seen,
        flos=trainer.state.total_flos,
        events=events.seen,
        update={n: p.detach() - start[n] for n, p in model.named_parameters()},  # what the 3 steps changed
        after={n: p.detach().clone() for n, p in model.named_parameters()},
    )


def sequence_parallel(rank: int, P: int, dp: int, feature: str) -> dict:
    """Rank side: ``feature`` under SequenceParallelTrainer over a (dp, P/dp) mesh (one output directory for
    every rank, as on one node)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tokenring
    import tokenring.hf as thf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(P))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    mesh = init_device_mesh("cpu", (dp, P // dp), mesh_dim_names=("dp", "cp"))
    sp = thf.SequenceParallel(mesh, layout=FEATURES.get(feature, {}).get("layout", "zigzag"))
    shared = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    try:
        return run(feature, dp, sp, shared[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shared[0], ignore_errors=True)
        sp.close()
        thf.configure(group=dist.group.WORLD)
        tokenring.configure(layer=None)  # (SequenceParallelTrainer sets it under layout="auto")


def differences(got: dict, want: dict, padded: bool = False) -> dict:
    """Relative differences of every recorded quantity (exact ones: 0 or 1); ``padded``: batches padded per
    dp rank."""

    def seq(a, b):
        assert len(a) == len(b), (a, b)
        return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)

    targets = want["label_ids"]  # the logits compared: where a target is (pad positions' logits are no output)

    def tensor(a, b):
        if a is None or b is None:
            return 0.0 if a is None and b is None else 1.0
        if a.shape != b.shape:
            return 1.0
        real = (targets != -100).unsqueeze(-1).expand_as(b) if b.dim() == 3 else b != -100
        return hf_cases.rel(a[real], b[real]) if real.any() else 0.0

    return dict(
        loss=seq(got["loss"], want["loss"]),
        grad_norm=seq(got["grad_norm"], want["grad_norm"]),
        lr=seq(got["lr"], want["lr"]),
        eval=seq(got["eval"], want["eval"]),
        predict_loss=seq([got["predict_loss"]], [want["predict_loss"]]),
        logits=tensor(got["logits"], want["logits"]),
        label_ids=tensor(got["label_ids"], want["label_ids"]),
        bare=tensor(got["bare"], want["bare"]),
        tokens=float(got["tokens"] != want["tokens"]),
        # FLOPs count padded tokens, and dp ranks pad their own batches (as stock DDP does): not one process's count
        flos=seq([got["flos"]], [want["flos"]]) if not padded else 0.0,
        events=float(got["events"] != want["events"]),
        update=_update_error(got, want),
    )


def _update_error(got: dict, want: dict) -> float:
    """The largest difference of the parameter updates, relative to the largest update of the model, after one
    float32 step of the weight itself: a weight is only resolved to its own float32 spacing (2e-9 at 0.02, 1.2e-7
    at a norm's 1.0), so last-bit differences of a gradient may move it by one step either way."""
    worst = 0.0
    for n, u in want["update"].items():
        step = torch.finfo(u.dtype).eps * want["after"][n].abs()
        worst = max(worst, ((got["update"][n] - u).abs() - step).clamp_min(0).max().item())
    return worst / max(u.abs().max().item() for u in want["update"].values())


def refused(rank: int, P: int, dp: int, name: str) -> str:
    """Rank side: building SequenceParallelTrainer with ``REFUSED[name]``: the ValueError's message."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import TrainingArguments

    import tokenring.hf as thf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(P))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    kw = dict(REFUSED[name][0])
    sp = thf.SequenceParallel(init_device_mesh("cpu", (dp, P // dp), mesh_dim_names=("dp", "cp")))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, **kw.pop("args", {}))
            model = hf_cases.build("llama", "tokenring", **SMALL)
            try:
                thf.SequenceParallelTrainer(sp, model=model, args=args, **kw)
            except ValueError as e:
                return str(e)
            return "not refused"
    finally:
        sp.close()
