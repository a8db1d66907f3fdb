#!/usr/bin/env python3
"""Peak memory per rank of one whole training step (forward, backward, AdamW step) of a small Llama on P local
ranks, with transformers' loss (full ``(s, V)`` logits) and with the tiled loss
(:func:`tokenring.hf.causal_lm_loss`), at two vocabulary sizes; and the longest local length that fits a budget.

    .venv/bin/python bench/tiled_loss_memory.py [--ranks 4] [--vocabs 32000 128000] [--lengths 512 1024 2048]
                                               [--chunk 256] [--budget-gib 8]

Each configuration runs in fresh rank processes (one thread each): a warm-up step at 64 tokens per rank (so
libraries, gloo buffers and the optimizer's states are allocated), then one step at local length ``s``; the
growth of the peak resident memory (``ru_maxrss``) over that step is what the step itself needs. The ranks run
with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set at once (glibc otherwise keeps
freed chunks of varied sizes mapped, and the resident peak then counts memory no tensor holds any more). The budget
column fits ``growth = a + b * s`` to the measured lengths (least squares) and solves for the largest ``s``
with ``baseline + growth <= budget`` (``baseline``: the resident memory before the step). Writes
``bench/results/tiled_loss_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1 << 20,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


def rank_run(rank: int, P: int, s: int, vocab: int, tiled: bool, chunk: int) -> dict:
    import resource

    import torch
    import transformers

    import tokenring.hf as thf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, **MODEL)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="tokenring", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(n: int) -> float:
        ids = torch.randint(0, vocab, (1, n * P), generator=torch.Generator().manual_seed(n))
        batch = thf.shard_batch(ids, labels=ids)
        with thf.settings(strategy="token_ring"):
            loss = thf.causal_lm_loss(model, batch, chunk=chunk) if tiled else model(**batch).loss
            loss.backward()
        thf.all_reduce_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return thf.reduce_loss(loss).item()

    step(64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    loss = step(s)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(
        rank=rank, baseline_bytes=before, growth_bytes=peak - before, peak_bytes=peak, seconds=seconds, loss=loss
    )


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv=None) -> int:
    from tokenring.tools.bench import machine
    from tokenring.tools.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128000])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    a = ap.parse_args(argv)
    P, GiB, MiB = a.ranks, 2**30, 2**20
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each rank process starts
    runs = []
    for vocab in a.vocabs:
        for tiled in (False, True):
            for s in a.lengths:
                rows = spawn(rank_run, P, s, vocab, tiled, a.chunk, threads=1)
                worst = max(rows, key=lambda r: r["growth_bytes"])
                runs.append(
                    dict(
                        vocab=vocab,
                        tiled=tiled,
                        s=s,
                        ranks=rows,
                        growth_bytes=worst["growth_bytes"],
                        baseline_bytes=worst["baseline_bytes"],
                        loss=rows[0]["loss"],
                    )
                )
                print(
                    f"V={vocab} {'tiled' if tiled else 'full '} s={s}: step growth {worst['growth_bytes'] / MiB:.0f} "
                    f"MiB (baseline {worst['baseline_bytes'] / MiB:.0f} MiB), loss {rows[0]['loss']:.4f}",
                    flush=True,
                )
    lines = [
        f"# Tiled loss: peak memory of a training step per rank (P={P})",
        "",
        f"Command: `python bench/tiled_loss_memory.py {' '.join(argv or sys.argv[1:])}`".replace(" `", "`"),
        f"Machine: {machine()['cpu']}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; one thread per rank, gloo, float32; strategy token_ring; "
        f"MALLOC_MMAP_THRESHOLD_=65536.",
        "",
        f"Model: Llama, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, heads "
        f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']}, untied head; AdamW. Tiled loss chunk "
        f"{a.chunk} tokens. Growth: the peak resident memory of the step beyond the resident memory before it "
        f"(the worst rank).",
        "",
        "| vocab | loss | " + " | ".join(f"s={s} (MiB)" for s in a.lengths) + f" | longest s in {a.budget_gib:g} GiB |",
        "|---|---|" + "---|" * len(a.lengths) + "---|",
    ]
    budget = {}
    for vocab in a.vocabs:
        for tiled in (False, True):
            mine = [r for r in runs if r["vocab"] == vocab and r["tiled"] == tiled]
            base = max(r["baseline_bytes"] for r in mine)
            c0, c1 = fit([(r["s"], r["growth_bytes"]) for r in mine])
            longest = int((a.budget_gib * GiB - base - c0) / c1) if c1 > 0 else None
            budget[f"{vocab}/{'tiled' if tiled else 'full'}"] = dict(
                intercept_bytes=c0, bytes_per_token=c1, baseline_bytes=base, longest_s=longest
            )
            lines.append(
                f"| {vocab} | {'tiled' if tiled else 'full logits'} | "
                + " | ".join(f"{r['growth_bytes'] / MiB:.0f}" for r in mine)
                + f" | {longest:,} ({c1 / 1024:.0f} KiB/token) |"
            )
    lines += ["", "The budget column extrapolates the linear fit; it is not measured at that length."]
    for vocab in a.vocabs:
        full = [r for r in runs if r["vocab"] == vocab and not r["tiled"]]
        tile = [r for r in runs if r["vocab"] == vocab and r["tiled"]]
        ratio = ", ".join(f"s={f['s']}: {f['growth_bytes'] / t['growth_bytes']:.1f}x" for f, t in zip(full, tile))
        lines.append(
            f"- V={vocab}: full logits / tiled step growth {ratio}; losses equal to "
            f"{max(abs(f['loss'] - t['loss']) for f, t in zip(full, tile)):.1e}."
        )
    out = dict(
        command="python bench/tiled_loss_memory.py " + " ".join(argv or sys.argv[1:]),
        machine=machine(),
        model=MODEL,
        ranks=P,
        chunk=a.chunk,
        budget_gib=a.budget_gib,
        runs=runs,
        budget=budget,
    )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "tiled_loss_memory.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(HERE, "results", "tiled_loss_memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
