#!/usr/bin/env python3
"""The next turn's prefill over a persistent sharded KV cache: sharded pass-Q / relay / pass-KV / Ulysses vs the
replicated decode path, per turn, on P local ranks; and what the simulator predicts on GPU clusters.

    .venv/bin/python bench/extend.py [--ranks 4] [--rounds 2] [--quick]

Per model and cache length ``N``, P local gloo ranks (1 thread each, sharing the machine's cores) hold a
``ShardedCache`` of ``N`` tokens (random K/V rows, balanced over the ranks: a turn's cost does not depend on the
values, and building a 32K cache by prefill would take most of the run; exactness is what tests/test_extend.py
checks). Each turn feeds ``T`` new tokens with ``tokenring.hf.extend(..., strategy=s)``, then the cache is
rewound, so every method of every round sees the same cache. Methods run interleaved in each round; every run
is kept. Reported per (N, T, method): median seconds per turn (slowest rank) with min-max, bytes rank 0
received (the extend / decode log, all layers), the ratio to the replicated path, pass-KV's bytes over
pass-Q's, the best measured method, and what ``tokenring.hf.extend``'s ``auto`` runs, scored against it.

Models (Llama architecture, random weights, float32):
- ``demo``: the demo's model (hidden 512, 4 layers, 8/2 heads, d=64, MLP 1408, vocab 32000);
- ``wide``: hidden 3072, 2 layers, 24/8 heads (d=128), MLP 9216, vocab 1024: its projections and MLP cost
  about 220 MFLOP per token and layer, at least its attention over a 16K cache (4*N*H*d = 201 MFLOP), the
  kind of model the sharded path is for.

Simulator table: ``tokenring.sim.extend.simulate_extend`` per layer on ``h100-nvswitch-8`` (P=8) and on
``ib-2x8`` grown to 16 nodes of 8 (P=128), Llama-3-70B-like attention (64/8 heads, d=128, bf16), caches of
128K-1M tokens, T from 1K to 64K new tokens.
Writes ``bench/results/extend.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _results  # noqa: E402
import torch  # noqa: E402

MODELS = {
    "demo": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
    "wide": dict(
        hidden_size=3072,
        intermediate_size=9216,
        num_hidden_layers=2,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=1024,
    ),
}
METHODS = ("pass_q", "pass_q_relay", "pass_kv", "ulysses", "replicated")


def build(name: str):
    import transformers

    import tokenring.hf  # noqa: F401  (registers the attention)

    cfg = transformers.LlamaConfig(
        **MODELS[name], max_position_embeddings=1 << 20, rope_theta=10000.0, attention_dropout=0.0
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="tokenring", dtype=torch.float32).eval()


def filled_cache(model, N: int, rank: int, P: int):
    """A ShardedCache holding ``N`` tokens' K/V (random rows, balanced over the ranks), as after a prefill."""
    from tokenring.hf import ShardedCache

    c = model.config
    d = c.hidden_size // c.num_attention_heads
    cache = ShardedCache()
    counts = [N // P + (r < N % P) for r in range(P)]
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(c.num_hidden_layers):
        layer = cache._new_layer()
        cache.layers.append(layer)
        k, v = (torch.randn(1, c.num_key_value_heads, counts[rank], d, generator=g) for _ in range(2))
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        layer.counts, layer.total, layer.skip = list(counts), N, 1
    return cache


def snapshot(cache) -> list:
    """What :func:`rewind` restores: (rows, counts, total, skip, positions) per layer."""
    return [(x.keys.shape[2], list(x.counts), x.total, x.skip, x.positions) for x in cache.layers]


def rewind(cache, state) -> None:
    """Back to the cache as ``state`` (one (rows, counts, total, skip, positions) per layer) found it."""
    for layer, (n, counts, total, skip, positions) in zip(cache.layers, state):
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        layer.counts, layer.total, layer.skip, layer.positions = list(counts), total, skip, positions
    cache.spans.clear()  # the random rows stand for no token ids


def rank_fn(rank: int, P: int, model_name: str, N: int, Ts: list[int], methods: list[str], rounds: int) -> dict:
    import torch.distributed as dist

    import tokenring.hf as thf
    from tokenring.extend import Shards, split_new
    from tokenring.sim.extend import choose

    torch.set_num_threads(1)
    model = build(model_name)
    c = model.config
    cache = filled_cache(model, N, rank, P)
    state = snapshot(cache)
    runs, picks = [], {}
    for T in Ts:
        convo = torch.randint(0, c.vocab_size, (1, N + T), generator=torch.Generator().manual_seed(T))
        counts = cache.layers[0].counts
        ranges = split_new(counts, T)
        sh = Shards(tuple(x + b - a for x, (a, b) in zip(counts, ranges)), tuple(ranges))
        d = c.hidden_size // c.num_attention_heads
        picks[T] = choose(sh, 1, c.num_attention_heads, c.num_key_value_heads, d, torch.float32)
        for rnd in range(rounds):
            for m in methods:
                cache.log = []
                dist.barrier()
                t0 = time.perf_counter()
                thf.extend(model, cache, convo, strategy=m)
                dt = time.perf_counter() - t0
                runs.append(dict(T=T, method=m, round=rnd, seconds=dt, bytes=sum(x["bytes"] for x in cache.log)))
                rewind(cache, state)
    return dict(runs=runs, picks=picks)


def measure(P: int, model: str, N: int, Ts: list[int], rounds: int) -> list[dict]:
    from tokenring.tools.launch import spawn

    methods = [m for m in METHODS if m != "ulysses" or MODELS[model]["num_key_value_heads"] % P == 0]
    t0 = time.time()
    res = spawn(rank_fn, P, model, N, Ts, methods, rounds, threads=1, timeout=3600)
    rows = []
    for T in Ts:
        times = {}
        for m in methods:
            per_round = [
                max(
                    r["seconds"] for x in res for r in x["runs"] if r["T"] == T and r["method"] == m and r["round"] == i
                )
                for i in range(rounds)
            ]
            got = [r["bytes"] for r in res[0]["runs"] if r["T"] == T and r["method"] == m]
            times[m] = dict(median=median(per_round), runs=per_round, bytes_rank0=max(got))
        best = min(times, key=lambda m: times[m]["median"])
        sharded = [m for m in methods if m != "replicated"]
        best_sharded = min(sharded, key=lambda m: times[m]["median"])
        pick = res[0]["picks"][T]  # extend_attention's auto (the sharded schedules)
        rows.append(
            dict(
                model=model,
                N=N,
                T=T,
                P=P,
                methods=times,
                best=best,
                best_sharded=best_sharded,
                auto_sharded=pick,
                speedup_vs_replicated=times["replicated"]["median"] / times[best_sharded]["median"],
                pass_q_speedup_vs_replicated=times["replicated"]["median"] / times["pass_q"]["median"],
                kv_over_q_bytes=times["pass_kv"]["bytes_rank0"] / max(1, times["pass_q"]["bytes_rank0"]),
            )
        )
        r = rows[-1]
        print(
            f"{model} N={N} T={T}: "
            + ", ".join(f"{m} {v['median']:.2f}s {v['bytes_rank0'] / 1e6:.1f}MB" for m, v in times.items())
            + f" | best {best}, auto's schedule {pick}, vs replicated x{r['speedup_vs_replicated']:.2f}",
            flush=True,
        )
    print(f"  ({time.time() - t0:.0f} s)", flush=True)
    return rows


def score(r: dict) -> None:
    """What ``tokenring.hf.extend``'s ``auto`` runs (replicated for at most ``REPLICATE_PER_RANK`` new tokens
    per rank, else ``extend_attention``'s pick) and its time over the best measured method."""
    from tokenring.hf import REPLICATE_PER_RANK

    times = r["methods"]
    r.setdefault("auto_sharded", r.get("auto"))  # results files written before this split
    r["auto"] = "replicated" if r["T"] <= REPLICATE_PER_RANK * r["P"] else r["auto_sharded"]
    r["auto_score"] = times[r["auto"]]["median"] / times[r["best"]]["median"]


def predictions() -> list[dict]:
    from tokenring.extend import Shards, split_new
    from tokenring.sim.auto import _kernel
    from tokenring.sim.extend import candidates, simulate_extend
    from tokenring.sim.topology import get_topology

    out = []
    for name, P in (("h100-nvswitch-8", 8), ("ib-2x8", 128)):
        topo = get_topology(name, P)
        km = _kernel(topo, P)
        for N in (131072, 524288, 1048576):
            for T in (1024, 8192, 65536):
                counts = [N // P] * P
                ranges = split_new(counts, T)
                sh = Shards(tuple(c + b - a for c, (a, b) in zip(counts, ranges)), tuple(ranges))
                res = {s: simulate_extend(s, sh, 1, 64, 8, 128, 2, topo, km) for s in candidates(P, 64, 8)}
                res["replicated"] = simulate_extend("replicated", sh, 1, 64, 8, 128, 2, topo, km)
                out.append(dict(topology=name, P=P, N=N, T=T, **{s: r.to_dict() for s, r in res.items()}))
    return out


def kernel_rows(out: str) -> int:
    """Seconds per query row of one block kernel call against 8192 cached rows (8/2 heads, d=64, fp32, 1 thread),
    by the number of query rows: why pass_q attends visitors' queries together (``tokenring.extend.BATCH_ROWS``)."""
    from tokenring.kernels import block_forward
    from tokenring.tools import bench

    torch.set_num_threads(1)
    k, v = torch.randn(1, 8192, 2, 64), torch.randn(1, 8192, 2, 64)
    rows = []
    for nq in (64, 128, 256, 512, 1024, 2048):
        q = torch.randn(1, nq, 8, 64)
        block_forward(q, k, v, False, 0.125)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            block_forward(q, k, v, False, 0.125)
            times.append(time.perf_counter() - t0)
        rows.append(dict(rows=nq, seconds=times, us_per_row=median(times) / nq * 1e6))
    m = bench.machine()
    lines = [
        "# One block kernel call: time per query row by rows per call",
        "",
        f"Machine: {m['cpu']}, 1 thread, torch {torch.__version__}. 8192 key rows, 8 query / 2 K/V heads, d=64, "
        f"float32, non-causal; median of 7 calls. Command: `.venv/bin/python bench/extend.py --kernel-rows`.",
        "",
        "| query rows | µs per row (median) | min-max ms per call |",
        "|---|---|---|",
    ] + [
        f"| {r['rows']} | {r['us_per_row']:.0f} | {min(r['seconds']) * 1e3:.1f}-{max(r['seconds']) * 1e3:.1f} |"
        for r in rows
    ]
    _results.write(out, dict(machine=m, rows=rows), lines)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one small grid (a smoke run)")
    ap.add_argument("--grid", nargs="+", default=None, help="rows to run instead, as model:N:T[,T...]")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "extend"))
    ap.add_argument("--kernel-rows", action="store_true", help="only time the kernel by query rows per call")
    ap.add_argument("--from-json", default=None, help="score the rows of an earlier results file again")
    a = ap.parse_args(argv)
    if a.kernel_rows:
        return kernel_rows(os.path.join(HERE, "results", "extend_kernel_rows"))
    from tokenring.tools import bench

    grid = (
        [(g.split(":")[0], int(g.split(":")[1]), [int(t) for t in g.split(":")[2].split(",")]) for g in a.grid]
        if a.grid
        else [("demo", 4096, [16, 512])]
        if a.quick
        else [
            ("demo", 16384, [16, 128, 512, 2048, 8192]),
            ("demo", 32768, [16, 512, 2048]),
            ("demo", 65536, [512]),
            ("wide", 16384, [512]),
        ]
    )
    if a.from_json:  # score and print earlier measurements again
        with open(a.from_json) as f:
            rows = json.load(f)["rows"]
    else:
        rows = []
        for model, N, Ts in grid:
            rows += measure(a.ranks, model, N, Ts, a.rounds)
    for r in rows:
        score(r)
    sims = predictions()
    cmd = f".venv/bin/python bench/extend.py --ranks {a.ranks} --rounds {a.rounds}" + (" --quick" if a.quick else "")
    cmd += (" --grid " + " ".join(a.grid) if a.grid else "") + (
        f" --out {os.path.relpath(a.out, os.path.dirname(HERE))}" if a.out != ap.get_default("out") else ""
    )
    if a.from_json:
        cmd += f" (scored again: --from-json {os.path.relpath(a.from_json, os.path.dirname(HERE))})"
    m = bench.machine()
    lines = [
        f"# Next-turn prefill over a sharded KV cache: P={a.ranks} local ranks",
        "",
        f"Machine: {m['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}, gloo on loopback, {a.ranks} ranks "
        f"x 1 thread sharing the cores. Command: `{cmd}`. Each row: median over {a.rounds} interleaved rounds "
        f"(min-max) of the slowest rank's seconds per turn (`tokenring.hf.extend` of T new tokens over a cache of "
        f"N), and the bytes rank 0 received over all layers. `replicated`: every rank runs the model on all T "
        f"tokens (the decode path). Models: see the script's docstring.",
        "",
        "| model | N | T | " + " | ".join(METHODS) + " | best sharded | vs replicated | pass-KV / pass-Q bytes | "
        "auto: what it runs (time / best) |",
        "|---|---|---|" + "---|" * len(METHODS) + "---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for meth in METHODS:
            v = r["methods"].get(meth)
            cells.append(
                "-"
                if v is None
                else f"{v['median']:.2f} s ({min(v['runs']):.2f}-{max(v['runs']):.2f}), {v['bytes_rank0'] / 1e6:.1f} MB"
            )
        lines.append(
            f"| {r['model']} | {r['N']} | {r['T']} | "
            + " | ".join(cells)
            + f" | {r['best_sharded']} | x{r['speedup_vs_replicated']:.2f} | {r['kv_over_q_bytes']:.1f} | "
            f"{r['auto']} ({r['auto_score']:.2f}) |"
        )
    lines += [
        "",
        "## Simulator: one attention layer, Llama-3-70B-like heads (64/8, d=128, bf16), balanced cache",
        "",
        "`tokenring.sim.extend.simulate_extend`; `replicated` is the attention part of the decode path only (the "
        "model's per-token work, replicated P times there, is not in it). ms per layer; bytes rank 0 receives.",
        "",
        "| topology | P | N | T | pass_q | pass_q_relay | pass_kv | ulysses | replicated | best | pass-KV / pass-Q "
        "bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sims:
        names = ("pass_q", "pass_q_relay", "pass_kv", "ulysses", "replicated")
        best = min((x for x in names[:4] if x in s), key=lambda x: s[x]["time"])
        lines.append(
            f"| {s['topology']} | {s['P']} | {s['N']} | {s['T']} | "
            + " | ".join(
                f"{s[x]['time'] * 1e3:.2f} ({s[x]['bytes_in'] / 1e6:.1f} MB)" if x in s else "- (H % P)" for x in names
            )
            + f" | {best} | {s['pass_kv']['bytes_in'] / max(1, s['pass_q']['bytes_in']):.1f} |"
        )
    _results.write(a.out, dict(machine=m, command=cmd, models=MODELS, rows=rows, simulated=sims), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
