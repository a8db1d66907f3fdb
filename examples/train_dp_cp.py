#!/usr/bin/env python3
"""Data x sequence parallel training of a small Llama: a transformers Trainer, or FSDP2 in a plain loop.

    torchrun --nproc-per-node 4 examples/train_dp_cp.py --dp 2 --stack trainer   # or --stack fsdp2
    (CPU: add --backend gloo; a file rendezvous: --init-method file:///tmp/rdv)

Tokenring runs each sample's attention over the ``cp = world / dp`` ranks of a (dp, cp) device mesh; the
gradient is averaged by DDP (inside the Trainer) or FSDP2 over all ranks, with each rank's loss scaled by
:class:`tokenring.hf.SequenceParallel` so that the average is the global mean's gradient. The samples have
random lengths, packed by transformers' stock ``DataCollatorWithFlattening`` (no length rule: any total length
splits). Rank 0 checks the first step's loss against the same model on the whole global batch in one process
and prints ``check vs one process: OK``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import tokenring.hf as thf
from tokenring.hf import SequenceParallel

CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=False,
)


def build(attn: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (cp = world / dp)")
    ap.add_argument("--stack", choices=["trainer", "fsdp2"], default="trainer")
    ap.add_argument("--seq", type=int, default=128, help="most tokens per sample (lengths are random, 1 to this)")
    ap.add_argument("--batch", type=int, default=2, help="samples per dp rank and step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="gloo" if not torch.cuda.is_available() else "nccl")
    ap.add_argument("--init-method", default="env://")
    a = ap.parse_args()
    dist.init_process_group(
        a.backend, init_method=a.init_method, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    W, rank = dist.get_world_size(), dist.get_rank()
    device = "cuda" if a.backend == "nccl" else "cpu"
    mesh = init_device_mesh(device, (a.dp, W // a.dp), mesh_dim_names=("dp", "cp"))
    sp = SequenceParallel(mesh)  # tokenring.hf layers now run over mesh["cp"]
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, a.seq + 1, (a.dp * a.batch * a.steps,), generator=gen).tolist()
    data = [dict(input_ids=torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist()) for n in lengths]
    collate = transformers.DataCollatorWithFlattening()  # one packed row, position ids restarting per sample
    model = build("tokenring")
    if rank == 0:  # what one process computes on the first global batch (the same weights)
        ref = build("sdpa")
        first = collate(data[: a.dp * a.batch])
        want = ref(**first, use_cache=False).loss.item()

    if a.stack == "trainer":
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out,
                per_device_train_batch_size=a.batch,
                max_steps=a.steps,
                logging_steps=1,
                report_to=[],
                use_cpu=device == "cpu",
                save_strategy="no",
                disable_tqdm=True,
                learning_rate=1e-3,
                train_sampling_strategy="sequential",
            )  # for the check only
            trainer = thf.SequenceParallelTrainer(sp, model=model, args=args, train_dataset=data, data_collator=collate)
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=sp.flat_mesh)  # FSDP2 over all dp x cp ranks
        fully_shard(model, mesh=sp.flat_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(a.steps):
            lo = (step * a.dp + sp.dp_rank) * a.batch  # this dp rank's samples of the step's global batch
            full = collate(data[lo : lo + a.batch])
            batch = sp.shard_batch(full["input_ids"], labels=full["labels"], position_ids=full["position_ids"])
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(sp.reduce_loss(loss).item())
    if rank == 0:
        print("losses:", ", ".join(f"{x:.4f}" for x in losses))
        ok = abs(losses[0] - want) <= 1e-3 * abs(want)  # Trainer logs round to 4 digits
        print(f"check vs one process: first-step loss {losses[0]:.4f} vs {want:.4f}: {'OK' if ok else 'FAILED'}")
    sp.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
