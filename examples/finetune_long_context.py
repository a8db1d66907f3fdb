"""Long-context fine-tuning step on P local ranks, checked against the same step in one process.

A Llama-architecture model (random weights from a config, GQA; or ``--model PATH``, a local checkpoint) trains
on one long sequence sharded over the ranks (zigzag). Each rank:

1. takes its shard of the batch: ``tokenring.hf.shard_batch(ids, labels=ids)`` gives the local ``input_ids``,
   their *global* ``position_ids`` (rotary embeddings), and the next-token labels shifted on the full sequence
   *before* sharding (under zigzag the next token of a rank's last local token lives on another rank), with the
   global token count so each rank's ``loss`` is its share of the global mean;
2. runs forward and backward (every attention layer goes through ``tokenring.attention``);
3. sums the gradients over the ranks (``tokenring.hf.all_reduce_grads``): they now equal single-process
   gradients, so every rank's AdamW step keeps the replicas identical.

    python examples/finetune_long_context.py [--seq 4096] [--ranks 4] [--steps 2] [--strategy auto]
"""

from __future__ import annotations

import argparse
import time

import torch

import tokenring.hf as thf
from tokenring.tools.launch import spawn


def build(model_path: str | None, attn: str, layers: int = 2):
    import transformers

    torch.manual_seed(0)
    if model_path:
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_path, attn_implementation=attn, dtype=torch.float32, local_files_only=True
        )
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=1 << 16,
        attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32)


def data(S: int, vocab: int, step: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(100 + step))


def train(
    rank: int, P: int, S: int, steps: int, strategy: str = "auto", model_path: str | None = None, check: bool = True
) -> dict:
    """Runs ``steps`` AdamW steps sharded; rank 0 also runs them in one process and compares. Returns rank 0's
    per-step losses, the worst relative gradient error of the first step (identical weights on both sides) and
    the worst parameter difference after the steps. After the first update the two runs evolve separately and
    AdamW amplifies float32 rounding on near-zero gradient entries (its update is about lr * sign(grad) there),
    so later parameters agree to about lr * 0.1, not to rounding."""
    thf.configure(strategy=strategy)
    model = build(model_path, "tokenring").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref = ref_opt = None
    if check and rank == 0:
        ref = build(model_path, "sdpa").train()
        ref.load_state_dict(model.state_dict())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    out = dict(loss=[], ref_loss=[], grad_rel=0.0, time=[])
    for step in range(steps):
        ids = data(S, model.config.vocab_size, step)
        t0 = time.perf_counter()
        batch = thf.shard_batch(ids, labels=ids)
        loss = model(**batch).loss  # this rank's share of the global mean
        loss.backward()
        thf.all_reduce_grads(model)  # sum of shares' gradients = single-process gradient
        total = thf.reduce_loss(loss)
        opt.step()
        out["time"].append(time.perf_counter() - t0)
        out["loss"].append(total.item())
        if ref is not None:
            ref_loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
            ref_loss.backward()
            if step == 0:  # same weights on both sides: gradients must agree to float32 rounding
                for p, q in zip(model.parameters(), ref.parameters()):
                    e = ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                    out["grad_rel"] = max(out["grad_rel"], e)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            out["ref_loss"].append(ref_loss.item())
        opt.zero_grad(set_to_none=True)
    if ref is not None:
        out["param_diff"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--model", default=None, help="local checkpoint directory (no network)")
    a = ap.parse_args(argv)
    r = spawn(train, a.ranks, a.seq, a.steps, a.strategy, a.model)[0]
    for i, (l, rl, t) in enumerate(zip(r["loss"], r["ref_loss"], r["time"])):
        print(f"step {i}: loss {l:.6f} (single process {rl:.6f}), {t:.1f} s on {a.ranks} ranks")
    print(
        f"first step: worst relative gradient difference {r['grad_rel']:.2e} (max |dgrad| / max |grad|, per "
        f"parameter); after {a.steps} AdamW steps (lr 1e-3) parameters differ by at most {r['param_diff']:.2e}"
    )
    ok = r["grad_rel"] < 1e-4 and max(abs(x - y) for x, y in zip(r["loss"], r["ref_loss"])) < 1e-5
    print("matches single process:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
