#!/usr/bin/env python3
"""Generation over a sequence-sharded KV cache vs one process: prefill, per-token latency, cache memory, bytes.

    .venv/bin/python bench/decode.py [--prompt 4096] [--new 64] [--ranks 2 4]

A Llama-architecture model with random weights (hidden 512, 4 layers, 8 query / 2 KV heads, head dim 64,
vocab 32000, float32). Per P: P local gloo ranks (the machine's cores shared, 1 thread each) run
``tokenring.hf.prefill`` (sharded prompt, TokenRing attention) and ``model.generate`` greedy over the sharded
cache; one process (as many threads as cores) runs ``model.generate`` with transformers' own cache and sdpa.
Reported: prefill seconds (one process: ``generate`` of one token), decode seconds per token (ranks:
``generate``'s time / new tokens; one process: the extra time of ``new`` over one token / ``new - 1``), K/V cache
bytes per rank
vs the single process's, bytes each rank received per decode step (from the decode log) vs the formula
``layers * (P-1) * B*t*H*(d+1) * 4``, and whether the generated ids equal the single process's (and the max
logit difference). Writes ``bench/results/decode.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402
import torch  # noqa: E402

CFG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=65536,
    rope_theta=10000.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


def build(attn: str):
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(
        transformers.LlamaConfig(**CFG), attn_implementation=attn, dtype=torch.float32
    ).eval()


def gen_kw(new: int) -> dict:
    return dict(
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )


def rank_fn(rank: int, P: int, prompt: int, new: int) -> dict:
    import tokenring.hf as thf

    torch.set_num_threads(1)
    model = build("tokenring")
    ids = torch.randint(0, CFG["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    cache = thf.prefill(model, ids)
    t1 = time.perf_counter()
    cache.log = []
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **gen_kw(new))
    t2 = time.perf_counter()
    steps = [
        sum(r["bytes"] for r in cache.log[i : i + CFG["num_hidden_layers"]])
        for i in range(0, len(cache.log), CFG["num_hidden_layers"])
    ]
    return dict(
        prefill_s=t1 - t0,
        decode_s_per_token=(t2 - t1) / new,
        cache_bytes=cache.nbytes(),
        step_bytes=steps,
        ids=out.sequences[0, prompt:].tolist(),
        logits=[x[0].tolist() for x in out.logits[:4]],
    )


def single(prompt: int, new: int) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    model = build("sdpa")
    ids = torch.randint(0, CFG["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, **gen_kw(1))  # prefill + the first token
        t1 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **gen_kw(new))
        t2 = time.perf_counter()
    cache = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in out.past_key_values.layers)
    # decode per token: the difference of the two generate calls over the extra new - 1 tokens
    return dict(
        prefill_s=t1 - t0,
        decode_s_per_token=((t2 - t1) - (t1 - t0)) / (new - 1),
        cache_bytes=cache,
        ids=out.sequences[0, prompt:].tolist(),
        logits=[x[0].tolist() for x in out.logits[:4]],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode"))
    a = ap.parse_args(argv)
    from tokenring.decode import step_bytes
    from tokenring.tools import bench
    from tokenring.tools.launch import spawn

    one = single(a.prompt, a.new)
    print(
        f"single process: prefill {one['prefill_s']:.2f} s, {one['decode_s_per_token'] * 1e3:.1f} ms/token, "
        f"cache {one['cache_bytes'] / 1e6:.1f} MB",
        flush=True,
    )
    runs = []
    for P in a.ranks:
        res = spawn(rank_fn, P, a.prompt, a.new, threads=1)
        formula = CFG["num_hidden_layers"] * step_bytes(1, 1, CFG["num_attention_heads"], 64, P)
        r0 = res[0]
        row = dict(
            P=P,
            prefill_s=max(r["prefill_s"] for r in res),
            decode_s_per_token=max(r["decode_s_per_token"] for r in res),
            cache_bytes_per_rank=[r["cache_bytes"] for r in res],
            step_bytes_median=median(r0["step_bytes"][1:]) if len(r0["step_bytes"]) > 1 else None,
            step_bytes_formula=formula,
            same_ids=all(r["ids"] == one["ids"] for r in res),
            ranks_agree=all(r["ids"] == r0["ids"] for r in res),
            max_logit_diff=max(abs(x - y) for s1, s2 in zip(r0["logits"], one["logits"]) for x, y in zip(s1, s2)),
        )
        runs.append(row)
        print(
            f"P={P}: prefill {row['prefill_s']:.2f} s, {row['decode_s_per_token'] * 1e3:.1f} ms/token, cache/rank "
            f"{max(row['cache_bytes_per_rank']) / 1e6:.2f} MB "
            f"({max(row['cache_bytes_per_rank']) / one['cache_bytes']:.3f}"
            f" of one process), {row['step_bytes_median']} B/step received (formula {formula}), same ids: "
            f"{row['same_ids']}, max |dlogit| (first 4 steps) {row['max_logit_diff']:.2g}",
            flush=True,
        )
    lines = [
        f"# Generation over a sharded KV cache: prompt {a.prompt}, {a.new} new tokens (greedy)",
        "",
        f"Machine: {bench.machine()['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}, gloo on loopback; "
        f"P ranks x 1 thread share the cores, one process uses all of them. Model: Llama, hidden 512, 4 layers, "
        f"8 / 2 heads, d=64, vocab 32000, float32, random weights. Command: `.venv/bin/python bench/decode.py "
        f"--prompt {a.prompt} --new {a.new} --ranks {' '.join(map(str, a.ranks))}`.",
        "",
        "| run | prefill s | decode ms/token | KV cache per rank MB | vs one process | bytes received per step "
        "(all layers) | formula | same ids as one process | max logit diff (4 steps) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| one process | {one['prefill_s']:.2f} | {one['decode_s_per_token'] * 1e3:.1f} | "
        f"{one['cache_bytes'] / 1e6:.2f} | 1.000 | - | - | - | - |",
    ]
    for r in runs:
        c = max(r["cache_bytes_per_rank"])
        lines.append(
            f"| P={r['P']} | {r['prefill_s']:.2f} | {r['decode_s_per_token'] * 1e3:.1f} | {c / 1e6:.2f} | "
            f"{c / one['cache_bytes']:.3f} | {r['step_bytes_median']} | {r['step_bytes_formula']} | "
            f"{r['same_ids']} | {r['max_logit_diff']:.1e} |"
        )
    _results.write(
        a.out, dict(machine=bench.machine(), prompt=a.prompt, new=a.new, model=CFG, single=one, runs=runs), lines
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
