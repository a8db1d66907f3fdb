#!/usr/bin/env python3
"""A long GRPO rollout, sequence-parallel against one process: memory and time of generation and of the training
step (tokenring.hf.trl.SequenceParallelGRPOTrainer vs TRL's GRPOTrainer).

    .venv/bin/python bench/grpo_rollout.py [--ranks 4] [--prompt 512] [--completion 8192] [--rounds 2]

One GRPO step on a small Llama (hidden 128, 2 layers, 4/2 heads of 32, vocab 128, float32, random weights): one
prompt of ``--prompt`` tokens, 2 generations of exactly ``--completion`` tokens each (``min_new_tokens``),
``beta=0``, ``num_iterations=1``. The sharded run uses ``--ranks`` local gloo ranks of 1 thread each, the one
process 2 threads: both on the same 2 cores. Rounds alternate the two. Measured per rank:

- generation: seconds in TRL's ``_generate_single_turn`` (prefill + decode), and the KV cache's bytes when it
  ends (tokenring's ``ShardedCache.nbytes()``; transformers' cache tensors in one process);
- training: seconds of the loss's forward (``compute_loss``) and of its backward, and the bytes of the tensors
  autograd keeps for the backward (saved-tensor hooks, each storage once, the weights apart: the activations);
- the process's peak resident set (``ru_maxrss``: everything, the interpreter and torch included).

Writes ``bench/results/grpo_rollout.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(127)} | {"</s>": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", eos_token="</s>")


def _cache_bytes(cache) -> int:
    """Bytes of a transformers cache's key and value tensors."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def step(rank: int, P: int, prompt: int, completion: int, sharded: bool) -> dict:
    """One GRPO step on this rank; what it measured."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import tokenring.hf as thf
    import tokenring.hf.trl as ttrl

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(P))
    cfg = LlamaConfig(**CONFIG, max_position_embeddings=prompt + completion + 64)
    torch.manual_seed(0)
    attn = "tokenring" if sharded else "sdpa"
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    text = " ".join(str(i) for i in torch.randint(1, 127, (prompt,), generator=gen).tolist())
    out: dict = {"generate_s": 0.0, "forward_s": 0.0, "backward_s": 0.0}
    caches: list = []

    def reward(completions, **kwargs):
        return [float(len(c) % 7) for c in completions]

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=completion,
            generation_kwargs=dict(min_new_tokens=completion),
            max_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        kw = dict(model=model, reward_funcs=reward, args=args, processing_class=_tokenizer())
        kw["train_dataset"] = Dataset.from_list([{"prompt": text}] * 2)
        sp = thf.SequenceParallel() if sharded else None
        trainer = ttrl.SequenceParallelGRPOTrainer(sp, **kw) if sharded else GRPOTrainer(**kw)

        generate_turn = trainer._generate_single_turn

        def timed_generation(*a, **k):
            t = time.perf_counter()
            res = generate_turn(*a, **k)
            out["generate_s"] += time.perf_counter() - t
            return res

        if sharded:
            prefill = ttrl.prefill

            def keep(*a, **k):
                caches.append(prefill(*a, **k))
                return caches[-1]

            ttrl.prefill = keep
        else:
            plain = type(model).generate

            def generate(*a, **k):
                res = plain(model, *a, return_dict_in_generate=True, **k)
                caches.append(res.past_key_values)
                return res.sequences

            model.generate = generate
        compute_loss = trainer.compute_loss

        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def measured_loss(*a, **k):
            seen: set = set()
            out["saved_bytes"] = 0

            def pack(x):  # a tensor autograd keeps for the backward: count its storage once, weights apart
                ptr = x.untyped_storage().data_ptr()
                if ptr not in seen and ptr not in weights:
                    seen.add(ptr)
                    out["saved_bytes"] += x.untyped_storage().nbytes()
                return x

            t = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                loss = compute_loss(*a, **k)
            out["forward_s"] += time.perf_counter() - t
            return loss

        backward = trainer.accelerator.backward

        def timed_backward(loss, **k):
            t = time.perf_counter()
            backward(loss, **k)
            out["backward_s"] += time.perf_counter() - t

        trainer._generate_single_turn = timed_generation
        trainer.compute_loss = measured_loss
        trainer.accelerator.backward = timed_backward
        try:
            trainer.train()
        finally:
            if sharded:
                ttrl.prefill = prefill
                sp.close()
    out["kv_cache_bytes"] = caches[-1].nbytes() if sharded else _cache_bytes(caches[-1])
    out["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from tokenring.tools.launch import RankPool

    P, runs = args.ranks, {"sharded": [], "one": []}
    for _ in range(args.rounds):  # fresh processes per run: ru_maxrss is a process's peak
        with RankPool(P, threads=1, timeout=7200) as pool:
            runs["sharded"].append(pool.run(step, args.prompt, args.completion, True))
        with RankPool(1, threads=2, timeout=7200) as pool:
            runs["one"].append(pool.run(step, args.prompt, args.completion, False))
    tokens_gen = 2 * args.completion
    tokens_train = 2 * (args.prompt + args.completion)

    def per_run(how: str, key: str, reduce=max) -> list[float]:
        return [reduce(r[key] for r in run) for run in runs[how]]

    def cell(vals: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
        vals = [v * scale for v in vals]
        return f"{fmt.format(median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"

    rows, summary = [], {}
    for label, key, scale, fmt in (
        ("generation, s", "generate_s", 1, "{:.1f}"),
        ("loss forward, s", "forward_s", 1, "{:.2f}"),
        ("loss backward, s", "backward_s", 1, "{:.2f}"),
        ("KV cache at the end of generation, MB", "kv_cache_bytes", 1e-6, "{:.2f}"),
        ("kept for the backward (activations), MB", "saved_bytes", 1e-6, "{:.1f}"),
        ("peak resident set, MB", "maxrss_bytes", 1e-6, "{:.0f}"),
    ):
        s, o = per_run("sharded", key), per_run("one", key)
        ratio = median(s) / median(o)
        summary[key] = dict(sharded=median(s), one=median(o), ratio=ratio, ratio_to_share=ratio * P)
        share = f"{ratio * P:.2f}" if key.endswith("bytes") else "-"
        rows.append(f"| {label} | {cell(s, scale, fmt)} | {cell(o, scale, fmt)} | {ratio:.2f} | {share} |")
    gen_tps = (
        [tokens_gen / t for t in per_run("sharded", "generate_s")],
        [tokens_gen / t for t in per_run("one", "generate_s")],
    )
    train_s = (
        [f + b for f, b in zip(per_run("sharded", "forward_s"), per_run("sharded", "backward_s"))],
        [f + b for f, b in zip(per_run("one", "forward_s"), per_run("one", "backward_s"))],
    )
    train_tps = [tokens_train / t for t in train_s[0]], [tokens_train / t for t in train_s[1]]
    summary["generate_tokens_per_s"] = dict(sharded=median(gen_tps[0]), one=median(gen_tps[1]))
    summary["train_tokens_per_s"] = dict(sharded=median(train_tps[0]), one=median(train_tps[1]))
    lines = [
        "# A long GRPO rollout: sequence-parallel vs one process",
        "",
        f"Command: `.venv/bin/python bench/grpo_rollout.py --ranks {P} --prompt {args.prompt} --completion "
        f"{args.completion} --rounds {args.rounds}`. Machine: 2-core AMD EPYC VM, torch CPU. One GRPO step: a prompt "
        f"of {args.prompt} tokens, 2 generations of {args.completion} tokens each, a Llama of hidden 128, 2 layers, "
        f"4/2 heads of 32, vocab 128, float32. Sharded: SequenceParallelGRPOTrainer on {P} local gloo ranks of 1 "
        "thread each; one process: TRL's GRPOTrainer with 2 threads; the same 2 cores. Busiest rank, median (min-max) "
        f"over {args.rounds} rounds, the two alternating. Share = sharded / (one process / {P}): 1.00 is 1/{P}.",
        "",
        f"| per rank | sharded ({P} ranks) | one process | sharded / one | share |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Generation: {cell(gen_tps[0])} tokens/s sharded, {cell(gen_tps[1])} in one process ({tokens_gen} tokens "
        f"decoded). Training step (loss forward + backward over {tokens_train} tokens): {cell(train_tps[0])} tokens/s "
        f"sharded, {cell(train_tps[1])} in one process. Each rank's KV cache holds its share of the prompt and of "
        "the completions' tokens (each decode step's new row goes to the rank holding fewest); the training forward "
        "keeps each rank's share of the activations, plus the gathered (B, S) log-probabilities and entropies.",
    ]
    data = dict(args=vars(args), summary=summary, runs=runs)
    _results.write(os.path.join(HERE, "results", "grpo_rollout"), data, lines)


if __name__ == "__main__":
    main()
