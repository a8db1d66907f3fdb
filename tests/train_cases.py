"""Rank-side functions for tests/test_training.py: data x sequence parallel training with the stacks people
use (transformers.Trainer, accelerate, DDP, FSDP2) against the same model and global batch in one process."""

from __future__ import annotations

import contextlib
import os
import tempfile

import hf_cases
import torch
import torch.distributed as dist

import tokenring.hf as thf
from tokenring.hf import SequenceParallel
from tokenring.layouts import local_positions

SMALL = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def _env(rank: int, P: int) -> None:
    """What torchrun would set (the process group itself is already up)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(P),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(P),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",
    )


def samples(n: int, S: int, vocab: int) -> list[dict]:
    ids = hf_cases.tokens(S, vocab, B=n, seed=3)
    return [dict(input_ids=ids[i], labels=ids[i]) for i in range(n)]


def build(family: str | None, attn: str, over: dict | None = None):
    """The small Llama (float32; ``over``: config changes), or a family of tests/family_cases.py (float64; attn
    "sdpa": its reference)."""
    if family is None:
        return hf_cases.build("llama", attn, **SMALL, **(over or {}))
    import family_cases

    return family_cases.build(family, family_cases.FAMILIES[family][2] if attn == "sdpa" else attn, dtype=torch.float64)


def reference(model, data: list[dict], family: str | None = None, over: dict | None = None) -> tuple[float, dict]:
    """One process: the global batch's mean next-token loss and its gradients (transformers' sdpa)."""
    ref = build(family, "sdpa", over)
    ref.load_state_dict(model.state_dict())
    ids = torch.stack([d["input_ids"] for d in data])
    out = ref(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def compare(loss: float, grads: dict, want: tuple[float, dict]) -> dict:
    wl, wg = want
    return dict(loss=abs(loss - wl) / abs(wl), grad=max(hf_cases.rel(grads[n], g) for n, g in wg.items()))


def mesh_of(dp: int, P: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, P // dp), mesh_dim_names=("dp", "cp"))


def trainer_step(
    rank: int,
    P: int,
    dp: int,
    S: int,
    per_device: int,
    accumulate: int = 1,
    tiled: int | None = None,
    family: str | None = None,
) -> dict:
    """One optimizer step of SequenceParallelTrainer over a (dp, P/dp) mesh: the gradients before the
    optimizer step and the logged loss vs one process on the whole global batch (``family``: a model of
    tests/family_cases.py instead of the small Llama)."""
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    _env(rank, P)
    sp = SequenceParallel(mesh_of(dp, P))
    try:
        model = build(family, "tokenring")
        data = samples(dp * per_device * accumulate, S, model.config.vocab_size)
        want = reference(model, data, family) if rank == 0 else None
        seen = {}

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                seen.update({n: p.grad.clone() for n, p in model.named_parameters()})

        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp,
                per_device_train_batch_size=per_device,
                max_steps=1,
                gradient_accumulation_steps=accumulate,
                logging_steps=1,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                learning_rate=1e-3,
                seed=0,
                disable_tqdm=True,
                max_grad_norm=1e9,
                per_device_eval_batch_size=per_device,
            )
            trainer = thf.SequenceParallelTrainer(
                sp,
                model=model,
                args=args,
                train_dataset=data,
                data_collator=default_data_collator,
                callbacks=[Grab()],
                tiled_loss=tiled,
            )
            # evaluate first (on the reference's weights), then train: the step must still be DDP's
            evaluated = trainer.evaluate(eval_dataset=data)["eval_loss"]
            trainer.train()
        logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        if rank:
            return {}
        res = compare(logged, seen, want)
        res["eval"] = abs(evaluated - want[0]) / want[0]
        return res
    finally:
        sp.close()
        thf.configure(group=dist.group.WORLD)


def _expect_value_error(fn, what: str) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{what} was not refused")


def stock_trainer_refused(rank: int, P: int, S: int) -> str:
    """A stock Trainer whose collator calls tokenring.hf.shard_batch (each rank shards its own sample, then DDP
    averages over the ranks sharing a sequence): refused on every rank at the first forward."""
    from transformers import Trainer, TrainingArguments

    _env(rank, P)
    model = hf_cases.build("llama", "tokenring", **SMALL)
    data = samples(P, S, model.config.vocab_size)

    def collate(rows):
        ids = torch.stack([r["input_ids"] for r in rows])
        return thf.shard_batch(ids, labels=ids)

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=1,
            max_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        return _expect_value_error(trainer.train, "a stock Trainer with shard_batch")


def accelerate_step(rank: int, P: int, dp: int, S: int, per_device: int, plain: bool = False) -> dict | str:
    """A plain accelerate loop (``prepare`` wraps the model in DDP over every rank): with SequenceParallel the
    first step's gradients equal one process's on the global batch; with plain shard_batch it is refused."""
    from accelerate import Accelerator

    _env(rank, P)
    mesh = mesh_of(dp, P)
    if plain:
        thf.configure(group=mesh["cp"].get_group())
    sp = SequenceParallel(mesh) if not plain else None
    try:
        model = hf_cases.build("llama", "tokenring", **SMALL)
        data = samples(dp * per_device, S, model.config.vocab_size)
        want = reference(model, data) if rank == 0 else None
        acc = Accelerator(cpu=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        wrapped, opt = acc.prepare(model, opt)
        dp_rank = mesh["dp"].get_local_rank()
        mine = data[dp_rank * per_device : (dp_rank + 1) * per_device]
        ids = torch.stack([d["input_ids"] for d in mine])
        if plain:
            cp = mesh["cp"].get_group()
            return _expect_value_error(
                lambda: wrapped(**thf.shard_batch(ids, labels=ids, group=cp)), "accelerate with plain shard_batch"
            )
        batch = sp.shard_batch(ids, labels=ids)
        loss = wrapped(**batch).loss
        acc.backward(loss)
        return _outcome(rank, model, sp.reduce_loss(loss).item(), want)
    finally:
        _reset(sp)


def _outcome(rank: int, model, loss: float, want) -> dict:
    """Rank 0: this step's loss and (full) gradients against the reference; the others: nothing (every rank
    gathers FSDP's sharded gradients: that is a collective)."""
    full = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return compare(loss, full, want) if rank == 0 else {}


def _reset(sp) -> None:
    if sp is not None:
        sp.close()
    thf.configure(group=dist.group.WORLD)


def fsdp_step(
    rank: int,
    P: int,
    dp: int,
    S: int,
    per_device: int,
    flat: bool,
    tiled: int | None = None,
    family: str | None = None,
    head: str = "root",
) -> dict:
    """FSDP2 with tokenring over cp: ``flat``: fully_shard over the flattened dp x cp mesh with SequenceParallel's
    loss scaling (FSDP averages over every rank); else fully_shard over dp and all_reduce_grads over cp (DTensor
    gradients). First step's gradients vs one process on the global batch (``family``: a model of
    tests/family_cases.py instead of the small Llama). ``head``: ``lm_head`` inside the root unit (``root``),
    its own unit (``own``, as TorchTitan-style recipes shard the output layer), or tied to the embedding
    (``tied``)."""
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_of(dp, P)
    sp = SequenceParallel(mesh) if flat else None
    try:
        tie = dict(tie_word_embeddings=head == "tied")
        model = build(family, "tokenring") if family else hf_cases.build("llama", "tokenring", **SMALL, **tie)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == (head == "tied")
        data = samples(dp * per_device, S, model.config.vocab_size)
        want = reference(model, data, family, tie) if rank == 0 else None
        dp_rank = mesh["dp"].get_local_rank()
        units = [*model.model.layers, *([model.lm_head] if head == "own" else [])]
        for unit in units:
            fully_shard(unit, mesh=sp.flat_mesh if flat else mesh["dp"])
        fully_shard(model, mesh=sp.flat_mesh if flat else mesh["dp"])
        mine = data[dp_rank * per_device : (dp_rank + 1) * per_device]
        ids = torch.stack([d["input_ids"] for d in mine])
        if flat:
            batch = sp.shard_batch(ids, labels=ids)
            with thf.tiled_loss(model, tiled) if tiled else contextlib.nullcontext():
                loss = model(**batch).loss
            loss.backward()
            got = sp.reduce_loss(loss).item()
        else:
            cp = mesh["cp"].get_group()
            thf.configure(group=cp)
            batch = thf.shard_batch(ids, labels=ids, group=cp)
            with thf.tiled_loss(model, tiled) if tiled else contextlib.nullcontext():
                loss = model(**batch).loss
            loss.backward()
            thf.all_reduce_grads(model, group=cp)
            total = thf.reduce_loss(loss, group=cp)  # this dp group's mean; average over dp
            dist.all_reduce(total, group=mesh["dp"].get_group())
            got = total.item() / dp
        return _outcome(rank, model, got, want)
    finally:
        _reset(sp)


def misuse_refused(rank: int, P: int, S: int) -> dict:
    """Each misuse of dp x cp raises ValueError on every rank: summing gradients over every rank on a
    (2, P/2) mesh (dp times the true gradient), all_reduce_grads on a DDP model (twice reduced), and ranks of
    one cp group holding different samples."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_of(2, P)
    cp = mesh["cp"].get_group()
    msgs = {}
    try:
        thf.configure(group=cp)
        model = hf_cases.build("llama", "tokenring", **SMALL)
        ids = hf_cases.tokens(S, model.config.vocab_size, seed=mesh["dp"].get_local_rank())
        model(**thf.shard_batch(ids, labels=ids, group=cp)).loss.backward()
        msgs["world"] = _expect_value_error(
            lambda: thf.all_reduce_grads(model, group=dist.group.WORLD), "all_reduce_grads over every rank"
        )
        msgs["ddp"] = _expect_value_error(
            lambda: thf.all_reduce_grads(DDP(model), group=cp), "all_reduce_grads on a DDP model"
        )
        sp = SequenceParallel(mesh)
        try:
            other = hf_cases.tokens(S, model.config.vocab_size, seed=rank)  # a per-rank sampler's batch
            msgs["samples"] = _expect_value_error(
                lambda: sp.shard_batch(other, labels=other), "different samples in one cp group"
            )
            msgs["plain"] = _expect_value_error(
                lambda: thf.shard_batch(ids, labels=ids), "plain shard_batch under SequenceParallel"
            )
        finally:
            sp.close()
    finally:
        thf.configure(group=dist.group.WORLD)
    return msgs


def single_process_trainer() -> dict:
    """SequenceParallelTrainer with no process group (one process: nothing is split): the logged loss is the
    model's own."""
    from transformers import TrainingArguments, default_data_collator

    sp = SequenceParallel()
    try:
        model = hf_cases.build("llama", "tokenring", **SMALL)
        data = samples(2, 32, SMALL["vocab_size"])
        want = reference(model, data)[0]
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp,
                per_device_train_batch_size=2,
                max_steps=1,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                disable_tqdm=True,
                logging_steps=1,
            )
            trainer = thf.SequenceParallelTrainer(
                sp, model=model, args=args, train_dataset=data, data_collator=default_data_collator
            )
            trainer.train()
        logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        return dict(loss=abs(logged - want) / want)
    finally:
        sp.close()


def wiring_step(rank: int, P: int, dp: int, how: str) -> dict | str:
    """One step wired one of the natural ways over a (dp, P/dp) mesh: ``ddp_dp`` (DDP over dp with
    SequenceParallel), ``fsdp_dp`` (fully_shard over dp with SequenceParallel), ``fsdp_world_plain`` (fully_shard
    over every rank with plain shard_batch), ``ddp_dp_plain`` (DDP over dp with plain shard_batch). Returns the
    errors against one process (rank 0), or the ValueError's message when refused."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_of(dp, P)
    plain = how.endswith("plain")
    sp = None if plain else SequenceParallel(mesh)
    try:
        model = hf_cases.build("llama", "tokenring", **SMALL)
        data = samples(dp * 2, 32, model.config.vocab_size)
        want = reference(model, data) if rank == 0 else None
        dp_rank = mesh["dp"].get_local_rank()
        ids = torch.stack([d["input_ids"] for d in data[dp_rank * 2 : dp_rank * 2 + 2]])
        cp = mesh["cp"].get_group()
        if plain:
            thf.configure(group=cp)
        if how.startswith("ddp"):
            wrapped = DDP(model, process_group=mesh["dp"].get_group())
        else:
            fsdp_mesh = mesh["dp"] if how == "fsdp_dp" else mesh[("dp", "cp")]._flatten("dp_cp_w")
            for layer in model.model.layers:
                fully_shard(layer, mesh=fsdp_mesh)
            wrapped = fully_shard(model, mesh=fsdp_mesh)
        batch = thf.shard_batch(ids, labels=ids, group=cp) if plain else sp.shard_batch(ids, labels=ids)
        try:
            loss = wrapped(**batch).loss
        except ValueError as e:
            return str(e)
        loss.backward()
        return _outcome(rank, model, sp.reduce_loss(loss).item(), want)
    finally:
        _reset(sp)


def after_closed_mesh(rank: int, P: int) -> float:
    """A SequenceParallel over a (2, P/2) mesh, closed; then a model sharded over all P ranks (the default group):
    its logits against one process (the closed mesh must leave the layers' group as it found it)."""
    _env(rank, P)
    thf.configure(group=dist.group.WORLD, layout="zigzag")
    SequenceParallel(mesh_of(2, P), layout="contiguous").close()
    model = hf_cases.build("llama", "tokenring")
    ref = hf_cases.build("llama", "sdpa")
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(3, 100, (1, 8 * P), generator=torch.Generator().manual_seed(0))
    pos = local_positions(8 * P, P, rank, "zigzag")  # this rank's zigzag rows of the P-way split
    with torch.no_grad():
        got = model(input_ids=ids[:, pos], position_ids=pos[None]).logits
        want = ref(input_ids=ids).logits[:, pos]
    return float((got - want).abs().max() / want.abs().max())
