#!/usr/bin/env python3
"""What a hybrid model's Gated DeltaNet layers cost when sharded by state passing (tokenring.recurrence), beside
the same layers left on each rank's shard with no exchange (wrong, the compute floor) and run whole on every
rank (``mixers="replicate"``).

    .venv/bin/python bench/hybrid_cost.py [--ranks 4] [--seq 16384 65536] [--rounds 3] [--replicate-upto 16384]

A Qwen3.5-style stack (transformers' ``qwen3_5_text``: Gated DeltaNet, full attention, Gated DeltaNet, full
attention; hidden 512, GDN 8 value / 4 key heads of 64, attention 8/2 heads of 64, float32, random weights) runs
one forward per round on each ``--seq`` tokens sharded over ``--ranks`` local gloo ranks (1 thread each), rounds
interleaving the variants. Per layer, timed by hooks around each layer on every rank after a barrier (slowest
rank reported):

- ``state passing``: what tokenring does;
- ``shard only``: the same layers left on each rank's shard (wrong results; the compute of an exchange-free
  scheme), the floor;
- ``replicated``: every GDN layer run on the gathered whole sequence on every rank (up to ``--replicate-upto``).

Also per GDN layer: the bytes its exchanges bring to a rank (all_gathers counted as they run), and the peak
memory its forward allocates with autograd recording (torch's profiler, CPU allocations: activations kept for
the backward included) on a rank, against one process running the same layer on the whole sequence. Writes
``bench/results/hybrid_cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402

CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    vocab_size=1024,
    max_position_embeddings=262144,
    attention_dropout=0.0,
    pad_token_id=0,
)
VARIANTS = ("state passing", "shard only", "replicated")


def peak_bytes(fn) -> int:
    """Peak of the CPU memory ``fn()`` allocates and still holds or frees while it runs (torch's profiler: each
    op's own allocations and frees in time order)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, live)
    del torch
    return peak


def run(rank: int, P: int, seqs: list[int], rounds: int, replicate_upto: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    import tokenring.hf as thf
    from tokenring import mixers

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.for_model("qwen3_5_text", **CONFIG)
    models = {}
    for how in VARIANTS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="tokenring").eval()
        if how == "shard only":
            mixers._prepared[model] = None  # its mixers stay on this rank's shard
        else:
            thf.prepare(model, mixers="replicate" if how == "replicated" else "state_passing")
        models[how] = model
    gdn = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    times: dict = {}
    moved: dict = {}
    current: list = [None]
    timing = [True]  # off while memory is measured (rank 0 alone runs the one-process layer)
    length = [0]  # the sequence the current forward runs
    real_gather = dist.all_gather

    def counting_gather(out, x, *a, **kw):  # bytes a rank receives, per (variant, S, layer)
        if current[0] is not None:
            moved[current[0]] = moved.get(current[0], 0) + sum(t.numel() * t.element_size() for t in out) * (P - 1) // P
        return real_gather(out, x, *a, **kw)

    dist.all_gather = counting_gather
    for how, model in models.items():
        for i, layer in enumerate(model.model.layers):
            mod = layer.linear_attn if i in gdn else layer.self_attn
            name = f"layer {i} ({'GDN' if i in gdn else 'attention'})"

            def pre(m, a, kw, name=name, how=how):
                if not timing[0]:
                    return
                dist.barrier()
                current[0] = f"{how}|{length[0]}|{name}"
                times.setdefault(current[0], []).append(-time.perf_counter())

            def post(m, a, kw, out):
                if not timing[0]:
                    return
                times[current[0]][-1] += time.perf_counter()
                current[0] = None

            mod.register_forward_pre_hook(pre, with_kwargs=True)
            mod.register_forward_hook(post, with_kwargs=True)
    step: dict = {}
    memory: dict = {}
    for S in seqs:
        ids = torch.randint(3, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
        batch = thf.shard_batch(ids)
        variants = [h for h in VARIANTS if h != "replicated" or S <= replicate_upto]
        length[0] = S
        with torch.no_grad():
            for _ in range(rounds):
                for how in variants:
                    dist.barrier()
                    t0 = time.perf_counter()
                    models[how](**batch, logits_to_keep=1)
                    step.setdefault(f"{how}|{S}", []).append(time.perf_counter() - t0)
        # memory: layer 0's GDN forward with autograd recording, sharded vs one process on the whole sequence
        hidden = torch.randn(1, S, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        mine = hidden[:, thf.shard_batch(torch.zeros(1, S, dtype=torch.long))["position_ids"][0]]
        layer = models["state passing"].model.layers[0].linear_attn
        current[0], timing[0] = None, False
        dist.barrier()
        memory[f"state passing|{S}"] = peak_bytes(lambda: layer(mine.requires_grad_(True)))
        if rank == 0:
            alone = models["shard only"].model.layers[0].linear_attn  # no hooks: the whole sequence, as one process
            memory[f"one process|{S}"] = peak_bytes(lambda: alone(hidden.clone().requires_grad_(True)))
        dist.barrier()
        timing[0] = True
    dist.all_gather = real_gather
    return dict(times=times, step=step, moved=moved, memory=memory)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicate-upto", type=int, default=16384)
    args = ap.parse_args()
    from tokenring.tools.launch import RankPool

    with RankPool(args.ranks, threads=1, timeout=7200) as pool:
        per_rank = pool.run(run, args.seq, args.rounds, args.replicate_upto)
    P = args.ranks
    names = sorted({k.split("|")[2] for k in per_rank[0]["times"]}, key=lambda n: int(n.split()[1]))

    def slowest(key: str, table: str) -> list[float] | None:
        if key not in per_rank[0][table]:
            return None
        return [max(r[table][key][i] for r in per_rank) for i in range(len(per_rank[0][table][key]))]

    def cell(runs):
        return "-" if runs is None else f"{median(runs):.3f} ({min(runs):.3f}-{max(runs):.3f})"

    lines = [
        "# Hybrid layers sharded by state passing: time, bytes and memory",
        "",
        f"Command: `.venv/bin/python bench/hybrid_cost.py --ranks {P} --seq {' '.join(map(str, args.seq))} --rounds "
        f"{args.rounds} --replicate-upto {args.replicate_upto}`. Machine: 2-core AMD EPYC VM, torch CPU (transformers' "
        f"torch Gated DeltaNet kernel), {P} local gloo ranks of 1 thread each on loopback, sharing its 2 cores. "
        "Model: transformers' qwen3_5_text (GDN, attention, GDN, attention; hidden 512; GDN 8 value / 4 key heads of "
        "64, conv kernel 4; attention 8/2 heads of 64; float32), one forward per round, zigzag layout. Seconds, "
        "slowest rank, median (min-max) of the rounds, variants interleaved in each round.",
        "",
    ]
    summary = {}
    for S in args.seq:
        lines += [
            f"## S = {S} ({S // P} tokens per rank)",
            "",
            "| layer | state passing | shard only (wrong: no exchange) | replicated | state passing / shard only |",
            "|---|---|---|---|---|",
        ]
        for name in names + ["whole forward"]:
            row = {}
            for how in VARIANTS:
                key = f"{how}|{S}" if name == "whole forward" else f"{how}|{S}|{name}"
                row[how] = slowest(key, "step" if name == "whole forward" else "times")
            ratio = median(row["state passing"]) / median(row["shard only"])
            summary[f"{S}|{name}"] = ratio
            lines.append(
                f"| {name} | {cell(row['state passing'])} | {cell(row['shard only'])} | {cell(row['replicated'])} "
                f"| {ratio:.2f}x |"
            )
        moved = {n: max(r["moved"].get(f"state passing|{S}|{n}", 0) for r in per_rank) for n in names if "GDN" in n}
        per_round = {n: b / args.rounds for n, b in moved.items()}
        rep = max(r["moved"].get(f"replicated|{S}|{names[0]}", 0) for r in per_rank) / args.rounds
        mem = max(r["memory"][f"state passing|{S}"] for r in per_rank)
        one = per_rank[0]["memory"][f"one process|{S}"]
        summary[f"{S}|bytes"] = per_round
        summary[f"{S}|memory"] = mem / (one / P)
        lines += [
            "",
            "Bytes a rank receives per GDN layer and forward: "
            + ", ".join(f"{n}: {b / 1e3:.1f} KB" for n, b in per_round.items())
            + (f" (replicated, layer 0: {rep / 1e6:.1f} MB)" if rep else "")
            + ".",
            f"Peak memory of layer 0's GDN forward with autograd recording: {mem / 1e6:.1f} MB on the busiest rank, "
            f"one process on the whole sequence {one / 1e6:.1f} MB; rank / (one process / P) = "
            f"{mem / (one / P):.2f}.",
            "",
        ]
    data = dict(args=vars(args), summary=summary, per_rank=per_rank)
    _results.write(os.path.join(HERE, "results", "hybrid_cost"), data, lines)


if __name__ == "__main__":
    main()
