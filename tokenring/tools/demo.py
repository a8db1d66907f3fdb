"""``tokenring demo``: a Llama-architecture model prefills a long prompt on 4 local ranks with every strategy,
next to the same model in one process: prefill time, tokens/s, peak memory per rank and the max logit difference;
the last line says where each strategy wins over shaped links (``bench/results/token_ring_wins.md``).

    tokenring demo [--seq 16384] [--ranks 4] [--model PATH] [--png tokenring-demo-timeline.png]
    tokenring demo --layer [--seq 16384] ...        # one attention layer instead of a model (needs only torch)
    tokenring demo --generate 32 [--seq 4096] ...   # prefill + generation over the sharded KV cache

Without ``--model`` the model is built from a config with random weights (hidden 512, 4 layers, 8 heads, 2 KV
heads: GQA, vocab 32000); ``--model PATH`` loads a local checkpoint (never the network). Every process builds
the same weights from the same seed. Peak memory is measured per process from ``/proc/self/status`` (VmHWM,
reset before each run via ``/proc/self/clear_refs``): the growth of the resident set during the prefill, so
the model weights and the Python runtime, present in every process anyway, are not counted.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import tokenring
from tokenring.strategies import STRATEGIES as _REGISTRY
from tokenring.strategies import runnable, why_not
from tokenring.tools.launch import spawn

STRATEGIES = tuple(_REGISTRY)


# ----------------------------------------------------------------------------------------------------------------
# Memory: per-process peak resident set


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> int:
    """Return freed heap to the OS, reset the peak-RSS mark; returns the current RSS in bytes (the baseline)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass
    rss = _status_kb("VmRSS")
    if rss is None:  # not Linux: fall back to the lifetime peak (no reset possible)
        return 0
    return rss * 1024


def _peak_bytes() -> int:
    hwm = _status_kb("VmHWM")
    if hwm is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return hwm * 1024


# ----------------------------------------------------------------------------------------------------------------
# Progress: rich when installed, plain lines otherwise


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.task, self.t0 = enabled, None, None, 0.0
        if enabled:
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                self.bar = Progress(
                    TextColumn("  {task.description:<28}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("layers + lm_head"),
                    TimeElapsedColumn(),
                    transient=False,
                )
                self.bar.start()
            except ImportError:
                self.bar = None

    def begin(self, name: str, total: int) -> None:
        self.name, self.total, self.done, self.t0 = name, total, 0, time.perf_counter()
        if not self.enabled:
            return
        if self.bar is not None:
            self.task = self.bar.add_task(name, total=total)
        else:
            print(f"  {name}: prefilling ({total - 1} layers + lm_head)", flush=True)

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.advance(self.task)
        elif self.done == self.total or self.done % max(1, self.total // 4) == 0:
            print(
                f"  {self.name}: {self.done}/{self.total} layers + lm_head, {time.perf_counter() - self.t0:.1f} s",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ----------------------------------------------------------------------------------------------------------------
# The model demo


def _spec(a) -> dict:
    return dict(
        model=a.model, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab, seq=a.seq
    )


def _build(spec: dict, attn: str):
    import transformers

    torch.manual_seed(0)
    if spec["model"]:
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], attn_implementation=attn, dtype=torch.float32, local_files_only=True
        ).eval()
    h = spec["hidden"]
    cfg = transformers.LlamaConfig(
        hidden_size=h,
        intermediate_size=(8 * h // 3 + 63) // 64 * 64,
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        vocab_size=spec["vocab"],
        max_position_embeddings=max(spec["seq"] + 4096, 2048),
        rope_theta=500000.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def _prompt(S: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(1))


def _hooks(model, progress: _Progress, body: dict) -> list:
    """Progress after each decoder layer and the lm_head; ``body["peak"]``: the peak RSS when the lm_head
    starts, i.e. of the transformer body (attention included), before the logits exist."""
    layers = list(model.model.layers) + [model.lm_head]
    hooks = [m.register_forward_hook(lambda *_: progress.step()) for m in layers]
    hooks.append(model.lm_head.register_forward_pre_hook(lambda *_: body.__setitem__("peak", _peak_bytes())))
    return hooks


def _single(rank: int, P: int, spec: dict, ref_path: str, show: bool) -> dict:
    """The whole prompt in one process with transformers' own sdpa attention; saves the logits."""
    model = _build(spec, "sdpa")
    ids = _prompt(spec["seq"], model.config.vocab_size)
    with torch.no_grad():
        model(input_ids=ids[:, :64], use_cache=False)  # warm-up
    progress = _Progress(show)
    body = {}
    _hooks(model, progress, body)
    base = _reset_peak()
    progress.begin("single process (sdpa)", model.config.num_hidden_layers + 1)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    dt = time.perf_counter() - t0
    peak = _peak_bytes() - base
    progress.close()
    torch.save(logits, ref_path)
    return dict(time=dt, peak=peak, body=body["peak"] - base, threads=torch.get_num_threads())


def _rank(rank: int, P: int, spec: dict, strategies: list, ref_path: str, show: bool) -> dict:
    import tokenring.hf as thf
    import tokenring.hf.config as hf_config
    from tokenring.comm import Trace
    from tokenring.layouts import local_positions

    model = _build(spec, "tokenring")
    S = spec["seq"]
    ids = _prompt(S, model.config.vocab_size)
    batch = thf.shard_batch(ids)
    warm = thf.shard_batch(ids[:, : 16 * P])
    traced_layer = model.config.num_hidden_layers // 2
    trace = {}
    hf_config._settings.config_fn = lambda m: (
        dict(trace=trace["t"]) if "t" in trace and getattr(m, "layer_idx", None) == traced_layer else None
    )
    with torch.no_grad():
        for name in strategies:  # warm-up: first calls, signature checks
            with thf.settings(strategy=name):
                model(**warm)
    progress = _Progress(show and rank == 0)
    body = {}
    _hooks(model, progress, body)
    ref = torch.load(ref_path, mmap=True)
    idx = local_positions(S, P, rank, "zigzag")
    res = {}
    for name in strategies:
        trace["t"] = Trace(rank)
        torch.distributed.barrier()
        base = _reset_peak()
        progress.begin(f"{name} ({P} ranks)", model.config.num_hidden_layers + 1)
        t0 = time.perf_counter()
        with torch.no_grad(), thf.settings(strategy=name):
            logits = model(**batch).logits
        dt = time.perf_counter() - t0
        peak = _peak_bytes() - base
        err = (logits - ref.index_select(1, idx)).abs().max().item()
        del logits
        res[name] = dict(time=dt, peak=peak, body=body["peak"] - base, err=err, events=trace.pop("t").events)
    progress.close()
    hf_config._settings.config_fn = None
    return res


def _model_main(a) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "tokenring demo needs transformers for the model demo: pip install -e '.[demo]' "
            "(or run `tokenring demo --layer`, which needs only torch)"
        )
        return 2
    P, S = a.ranks, a.seq
    if S % (2 * P):
        print(f"--seq {S} must be a multiple of 2*ranks = {2 * P} (zigzag layout)")
        return 2
    spec = _spec(a)
    named = a.strategies.split(",") if a.strategies else None
    strategies = list(named or STRATEGIES)
    if a.model:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(a.model, local_files_only=True)
        heads, kvh = c.num_attention_heads, getattr(c, "num_key_value_heads", c.num_attention_heads)
        what = f"{a.model}: {c.model_type}, hidden {c.hidden_size}, {c.num_hidden_layers} layers"
    else:
        heads, kvh = a.heads, a.kv_heads
        what = f"Llama-architecture model, random weights: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}"
    try:
        reasons = {name: why_not(name, heads, kvh, P) for name in strategies}
    except ValueError as e:  # an unknown name in --strategies
        print(f"tokenring demo: {e}")
        return 2
    # Strategies that cannot run these heads on these ranks (the hierarchical ones without a node size) are left
    # out of the table; only a name asked for with --strategies is reported.
    for name, reason in reasons.items():
        if reason:
            strategies.remove(name)
            if named:
                print(f"({name} cannot run here: {reason})")
    cores = os.cpu_count() or 1
    print(f"{what}, {heads} heads / {kvh} KV heads, float32")
    print(
        f"prefill of a {S}-token prompt: {P} local gloo ranks (zigzag, attn_implementation='tokenring', "
        f"{max(1, cores // P)} thread each) vs one process ({cores} threads, transformers' sdpa); "
        f"{cores} CPU cores"
    )
    # Large blocks straight from/to the OS, so the peak-RSS deltas measure live memory, not allocator caches.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    show = not a.quiet
    tmpdir = tempfile.mkdtemp(prefix="tokenring-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ref_path = os.path.join(tmpdir, "ref_logits.pt")
    t_start = time.perf_counter()
    try:
        single = spawn(_single, 1, spec, ref_path, show, threads=cores)[0]
        per_rank = spawn(_rank, P, spec, strategies, ref_path, show)
    finally:
        if os.path.exists(ref_path):
            os.remove(ref_path)
        os.rmdir(tmpdir)
    mb = 1 / 2**20
    print(
        f"\n{'':<16}{'prefill':>10}{'tokens/s':>10}{'peak mem/rank':>15}{'vs single':>11}"
        f"{'w/o logits':>12}{'vs single':>11}{'max |dlogit|':>14}"
    )
    print(
        f"{'single-process':<16}{single['time']:>9.1f}s{S / single['time']:>10.0f}{single['peak'] * mb:>12.0f} MB"
        f"{1:>10.2f}x{single['body'] * mb:>9.0f} MB{1:>10.2f}x{0:>14.1e}"
    )
    worst_err, ratios, bratios = 0.0, [], []
    for name in strategies:
        rs = [r[name] for r in per_rank]
        t = max(r["time"] for r in rs)
        peak = max(r["peak"] for r in rs)
        bpeak = max(r["body"] for r in rs)
        err = max(r["err"] for r in rs)
        worst_err = max(worst_err, err)
        ratios.append(single["peak"] / max(peak, 1))
        bratios.append(single["body"] / max(bpeak, 1))
        print(
            f"{name:<16}{t:>9.1f}s{S / t:>10.0f}{peak * mb:>12.0f} MB{peak / single['peak']:>10.2f}x"
            f"{bpeak * mb:>9.0f} MB{bpeak / max(single['body'], 1):>10.2f}x{err:>14.1e}"
        )
    print(
        f"peak memory per rank (growth of the process's resident set during the prefill, weights excluded) is "
        f"1/{min(ratios):.1f}-1/{max(ratios):.1f} of the single process's; before the logits (all layers, "
        f"attention included) 1/{min(bratios):.1f}-1/{max(bratios):.1f}"
    )
    if P > cores:
        print(
            f"note: {P} ranks share {cores} cores here, so rank times measure correctness and overhead, not a speed-up"
        )
    ok = worst_err < a.tol
    print(
        f"logits match the single-process model: {'yes' if ok else 'NO'} (max |dlogit| {worst_err:.2e}, "
        f"tolerance {a.tol:g})"
    )
    if a.png:
        try:
            from tokenring.tools.trace import plot_timeline

            plot_timeline(
                a.png,
                {n: [r[n]["events"] for r in per_rank] for n in strategies},
                title=f"attention of one layer (the middle one) during the {S}-token prefill, {P} ranks",
            )
            print(f"timeline of one attention layer per strategy: {a.png}")
        except ImportError as e:
            print(f"(no timeline PNG: {e}; pip install matplotlib)")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(_WHERE_EACH_WINS.format(model="as in this model" if kvh < heads else "not this model"))
    return 0 if ok else 1


# Where each strategy is fastest over shaped links, from the best-per-case column of
# bench/results/token_ring_wins.md (P=4, MHA and GQA 8/2 on mesh, ring-of-links and switch testbeds).
_WHERE_EACH_WINS = (
    "where each wins over shaped links (bench/results/token_ring_wins.md): token_ring with MHA on a switch and in "
    "mesh forward+backward; ring_bidir or direct pass-KV in the other MHA cases; pass-KV ring with GQA ({model}); "
    "ulysses in none. To see TokenRing win: sudo .venv/bin/python bench/token_ring_wins.py"
)


# ----------------------------------------------------------------------------------------------------------------
# Generation (--generate N): sharded prefill, then model.generate over the sharded KV cache


def _gen_kw(n: int) -> dict:
    return dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)


def _gen_single(rank: int, P: int, spec: dict, n: int) -> dict:
    model = _build(spec, "sdpa")
    ids = _prompt(spec["seq"], model.config.vocab_size)
    mask = torch.ones_like(ids)
    base = _reset_peak()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, **_gen_kw(1))  # prefill + the first token
        t1 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **_gen_kw(n))
        t2 = time.perf_counter()
    cache = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in out.past_key_values.layers)
    return dict(
        prefill=t1 - t0,
        per_token=((t2 - t1) - (t1 - t0)) / max(1, n - 1),
        cache=cache,
        peak=_peak_bytes() - base,
        ids=out.sequences[0, spec["seq"] :].tolist(),
    )


def _gen_rank(rank: int, P: int, spec: dict, n: int, strategy: str) -> dict:
    import tokenring.hf as thf

    model = _build(spec, "tokenring")
    ids = _prompt(spec["seq"], model.config.vocab_size)
    base = _reset_peak()
    with thf.settings(strategy=strategy):
        t0 = time.perf_counter()
        cache = thf.prefill(model, ids)
        t1 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), cache=cache, return_dict_in_generate=True, **_gen_kw(n)
            )
        t2 = time.perf_counter()
    return dict(
        prefill=t1 - t0,
        per_token=(t2 - t1) / n,
        cache=cache.nbytes(),
        peak=_peak_bytes() - base,
        ids=out.sequences[0, spec["seq"] :].tolist(),
    )


def _generate_main(a) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("tokenring demo --generate needs transformers: pip install -e '.[demo]'")
        return 2
    P, S, n = a.ranks, a.seq, a.generate
    spec = _spec(a)
    strategy = a.strategies.split(",")[0] if a.strategies else "auto"
    cores = os.cpu_count() or 1
    model = a.model or f"Llama, random weights, hidden {a.hidden}, {a.layers} layers, {a.heads}/{a.kv_heads} heads"
    print(
        f"generation: prefill a {S}-token prompt sharded over {P} local ranks (strategy {strategy!r}), then "
        f"{n} greedy tokens with model.generate over the sharded KV cache; vs one process ({cores} threads, "
        f"transformers' sdpa and cache). Model: {model}, float32"
    )
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    t_start = time.perf_counter()
    one = spawn(_gen_single, 1, spec, n, threads=cores)[0]
    ranks = spawn(_gen_rank, P, spec, n, strategy)
    mb = 1 / 2**20
    print(f"\n{'':<16}{'prefill':>9}{'ms/token':>10}{'KV cache/rank':>15}{'vs single':>11}{'peak mem/rank':>15}")
    print(
        f"{'single-process':<16}{one['prefill']:>8.1f}s{one['per_token'] * 1e3:>10.1f}{one['cache'] * mb:>12.1f} MB"
        f"{1:>10.2f}x{one['peak'] * mb:>12.0f} MB"
    )
    cache = max(r["cache"] for r in ranks)
    print(
        f"{f'{P} ranks':<16}{max(r['prefill'] for r in ranks):>8.1f}s{max(r['per_token'] for r in ranks) * 1e3:>10.1f}"
        f"{cache * mb:>12.1f} MB{cache / one['cache']:>10.2f}x{max(r['peak'] for r in ranks) * mb:>12.0f} MB"
    )
    same = all(r["ids"] == one["ids"] for r in ranks)
    print(f"generated ids equal the single process's on every rank: {'yes' if same else 'NO'}")
    if P > cores:
        print(f"note: {P} ranks share {cores} cores here, so times measure overhead, not a speed-up")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if same else 1


# ----------------------------------------------------------------------------------------------------------------
# The single attention layer demo (--layer): needs only torch


def _inputs(S: int, H: int, Hkv: int, d: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, S, h, d, generator=gen) for h in (H, Hkv, Hkv)]


def _layer_rank(rank: int, P: int, S: int, H: int, Hkv: int, d: int, repeats: int) -> dict:
    q, k, v = (tokenring.shard(t, dim=1, layout="zigzag") for t in _inputs(S, H, Hkv, d))
    res = {}
    for name in runnable(H, Hkv, P, STRATEGIES):
        out = tokenring.attention(q, k, v, causal=True, strategy=name)  # warm-up, checks shapes once
        times = []
        for _ in range(repeats):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            out = tokenring.attention(q, k, v, causal=True, strategy=name)
            times.append(time.perf_counter() - t0)
        full = tokenring.gather(out, dim=1, layout="zigzag")
        res[name] = dict(time=sorted(times)[len(times) // 2], out=full if rank == 0 else None)
    if rank == 0:  # single-process attention on the whole sequence, same machine, for the error and time
        qf, kf, vf = (t.transpose(1, 2) for t in _inputs(S, H, Hkv, d))
        torch.set_num_threads(torch.get_num_threads() * P)
        t0 = time.perf_counter()
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=H != Hkv).transpose(1, 2)
        single = time.perf_counter() - t0
        for r in res.values():
            r["max_err"] = (r.pop("out") - ref).abs().max().item()
        res["single-process"] = dict(time=single, max_err=0.0)
    return res


def _layer_main(a) -> int:
    head_dim = a.head_dim
    print(
        f"causal attention layer: S={a.seq} tokens, H={a.heads}, Hkv={a.kv_heads}, d={head_dim}, float32, "
        f"{a.ranks} local gloo ranks (zigzag layout), CPU"
    )
    res = spawn(_layer_rank, a.ranks, a.seq, a.heads, a.kv_heads, head_dim, a.repeats)[0]
    best = min(r["time"] for k, r in res.items() if k != "single-process")
    print(f"{'strategy':<16}{'time/call':>12}{'vs best':>10}{'max |err|':>12}")
    for name, r in res.items():
        print(f"{name:<16}{r['time'] * 1e3:>10.1f}ms{r['time'] / best:>9.2f}x{r['max_err']:>12.2e}")
    worst = max(r["max_err"] for r in res.values())
    ok = worst < 1e-4
    print(
        f"all strategies match single-process attention: {'yes' if ok else 'NO'} (max |err| {worst:.2e}, "
        f"float32 tolerance 1e-4)"
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenring demo", description=__doc__.splitlines()[0])
    ap.add_argument("--layer", action="store_true", help="one attention layer instead of a model (torch only)")
    ap.add_argument("--seq", type=int, default=16384, help="global sequence length (tokens)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", default=None, help="local checkpoint directory (from_pretrained, no network)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the random model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--strategies", default=None, help=f"comma-separated subset of {','.join(STRATEGIES)}")
    ap.add_argument("--png", default="tokenring-demo-timeline.png", help="timeline PNG ('' for none)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max |logit difference| accepted")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--head-dim", type=int, default=64, help="(--layer) head dim")
    ap.add_argument("--repeats", type=int, default=3, help="(--layer) timed calls per strategy")
    ap.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="prefill, then generate N greedy tokens over the sharded KV cache",
    )
    a = ap.parse_args(argv)
    if a.generate:
        return _generate_main(a)
    if a.layer:
        if a.kv_heads == 2 and "--kv-heads" not in (argv if argv is not None else sys.argv):
            a.kv_heads = a.heads  # the layer demo's historical default: MHA
        return _layer_main(a)
    return _model_main(a)


if __name__ == "__main__":
    raise SystemExit(main())
