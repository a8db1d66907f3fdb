#!/usr/bin/env python3
"""Host time per call: what Python spends around the kernels, on PyTorch's fake process group (every collective
and point-to-point op a no-op), so only the host and a tiny local compute are timed.

    .venv/bin/python bench/host_overhead.py            # writes bench/results/host_overhead.{md,json}
    .venv/bin/python bench/host_overhead.py --quick    # P=4 only, fewer calls

Each rank count ``P`` runs in its own process as rank 1 of ``P`` (one thread). Shapes as the issue states them:
B=1, 16 rows per rank, 8 query / 2 key-value heads, d=64, float32, causal. After a warm-up, rounds interleave the
variants (each round: ``--calls`` calls of every variant in turn); every round's microseconds per call are
kept. The floor is a minimal ring loop written here the way ring-flash-attn writes its loop: per step one
batched isend/irecv of K and V to the next rank, one CPU flash call returning the log-sum-exp, and an
LSE merge; P steps (causal: the diagonal step masked, the others below the diagonal, a zigzag-free loop that
does the same number of kernel calls). Ratios are medians over the floor's median in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

B, S_LOCAL, H, HKV, D = 1, 16, 8, 2, 64
CACHE = 1024  # decode: cached rows per rank


def _exchange(tensors, P: int):
    """Post one batched isend/irecv of ``tensors`` to the next rank; ``(works, received)``."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    nxt, prv = (rank + 1) % P, (rank - 1) % P
    tensors = [t.contiguous() for t in tensors]
    got = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt) for t in tensors] + [dist.P2POp(dist.irecv, t, prv) for t in got]
    return dist.batch_isend_irecv(ops), got


def _floor(q, k, v, P: int, causal: bool):
    """A minimal ring loop (forward): P steps of one batched K/V exchange, one flash call, one LSE merge.
    Returns ``(out (B, s, H, d) float32, lse (B, H, s))``."""
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qt = q.transpose(1, 2)
    out = lse = None
    for step in range(P):
        if step + 1 < P:
            works, (k2, v2) = _exchange([k, v], P)
        o, l = flash(qt, k.transpose(1, 2), v.transpose(1, 2), 0.0, causal and step == 0)[:2]
        if out is None:
            out, lse = o.float(), l
        else:  # out = out - sigmoid(l - lse) * (out - o); lse = lse - logsigmoid(lse - l)
            out = out - torch.sigmoid(l - lse).unsqueeze(-1) * (out - o)
            lse = lse - torch.nn.functional.logsigmoid(lse - l)
        if step + 1 < P:
            for w in works:
                w.wait()
            k, v = k2, v2
    return out.transpose(1, 2), lse


def _floor_backward(dout, q, k, v, out, lse, P: int, causal: bool):
    """A minimal ring backward, as ring-flash-attn writes it: per step one batched K/V exchange, one flash
    backward call, dQ summed here, and dK/dV summed into buffers that travel with their K/V (one more batched
    exchange per step; the last brings them home)."""
    import torch

    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    qt, ot, dot, lse = q.transpose(1, 2), out.transpose(1, 2), dout.transpose(1, 2), lse.contiguous()
    dq = torch.zeros(qt.shape, dtype=torch.float32)
    dk = dv = dk2 = dv2 = dkv_works = None
    for step in range(P):
        if step + 1 < P:
            works, (k2, v2) = _exchange([k, v], P)
        bdq, bdk, bdv = flash_bwd(dot, qt, k.transpose(1, 2), v.transpose(1, 2), ot, lse, 0.0, causal and step == 0)
        dq += bdq
        if dk is None:
            dk, dv = bdk.float(), bdv.float()
        else:
            for w in dkv_works:
                w.wait()
            dk, dv = dk2 + bdk, dv2 + bdv
        dkv_works, (dk2, dv2) = _exchange([dk, dv], P)
        if step + 1 < P:
            for w in works:
                w.wait()
            k, v = k2, v2
    for w in dkv_works:
        w.wait()
    return dq.transpose(1, 2), dk2.transpose(1, 2), dv2.transpose(1, 2)


def _decode_floor(q, k, v, P: int):
    """A minimal decode step: one CPU flash call over this rank's cached rows, its output and log-sum-exp in
    one all-gather, an LSE merge of the P partials. Returns (B, t, H, d)."""
    import torch
    import torch.distributed as dist

    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False
    )[:2]
    b, h, t, d = o.shape
    mine = torch.cat([o.reshape(b, -1), lse.reshape(b, -1)], 1)
    every = mine.new_empty((P, *mine.shape))
    dist.all_gather_single(every, mine.unsqueeze(0))
    n = h * t * d
    os_, lses = every[:, :, :n].view(P, b, h, t, d), every[:, :, n:].view(P, b, h, t)
    total = torch.logsumexp(lses, 0)
    return (os_ * torch.exp(lses - total).unsqueeze(-1)).sum(0).transpose(1, 2)


def _floor_fn():
    """The floor loops as one autograd function (as ring-flash-attn wraps its own)."""
    import torch

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, P, causal):
            out, lse = _floor(q, k, v, P, causal)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.P, ctx.causal = P, causal
            return out

        @staticmethod
        def backward(ctx, dout):
            return (*_floor_backward(dout, *ctx.saved_tensors, ctx.P, ctx.causal), None, None)

    return Floor.apply


FLOOR, FLOOR_FB = "floor: minimal ring loop", "floor: minimal ring loop, forward+backward"
FLOOR_DECODE = "floor: minimal decode step (one flash call, one all-gather, an LSE merge)"


def _variants(P: int, quick: bool, hf: bool = True):
    """name -> a function of no arguments making one call."""
    import torch

    import tokenring

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S_LOCAL, H, D, generator=g)
    k, v = (torch.randn(B, S_LOCAL, HKV, D, generator=g) for _ in range(2))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qd = torch.randn(B, 1, H, D, generator=g)
    kc, vc = (torch.randn(B, CACHE, HKV, D, generator=g) for _ in range(2))
    floor = _floor_fn()
    out = {
        FLOOR: lambda: _floor(q, k, v, P, True),
        FLOOR_FB: lambda: floor(qg, kg, vg, P, True).sum().backward(),
    }
    for s in ("ring", "token_ring", "ulysses"):
        out[f"attention {s}, forward"] = lambda s=s: tokenring.attention(q, k, v, causal=True, strategy=s)
    out["attention ring, forward+backward"] = lambda: (
        tokenring.attention(qg, kg, vg, causal=True, strategy="ring").sum().backward()
    )
    kn, vn = (torch.cat([c, torch.randn(B, 1, HKV, D, generator=g)], 1) for c in (kc, vc))  # + the new token
    out[FLOOR_DECODE] = lambda: _decode_floor(qd, kc, vc, P)
    out["decode_attention (1 token, 1024 cached rows per rank)"] = lambda: tokenring.decode_attention(qd, kc, vc)
    out["decode_attention, check=False (a model's later layers)"] = lambda: tokenring.decode_attention(
        qd, kc, vc, check=False
    )
    out["decode_attention, check=False, on the rank storing the new token"] = lambda: tokenring.decode_attention(
        qd, kn, vn, check=False, new=(0, 1)
    )
    import torch.distributed as dist

    from tokenring.strategies.extend import Shards

    rank, t = dist.get_rank(), S_LOCAL  # extend: t new tokens per rank over S_LOCAL cached rows per rank
    qe, ke, ve = torch.randn(B, t, H, D, generator=g), *(torch.randn(B, S_LOCAL + t, HKV, D, generator=g) for _ in "kv")
    shards = Shards(rows=(S_LOCAL + t,) * P, new=tuple((t * j, t * j + t) for j in range(P)))
    out[f"extend_attention pass_q ({t} new tokens, {S_LOCAL} cached rows per rank)"] = lambda: (
        tokenring.extend_attention(qe, ke, ve, new=shards.new[rank], strategy="pass_q", shards=shards)
    )
    out["extend_attention pass_q, state=None (a model's later layers: no check)"] = lambda: tokenring.extend_attention(
        qe, ke, ve, new=shards.new[rank], strategy="pass_q", shards=shards, state=None
    )
    from tokenring.kernels import block_forward

    out["decode's local kernel alone (block_forward)"] = lambda: block_forward(qd, kc, vc, False, D**-0.5)
    if hf:
        out.update(_hf_layer(P))
    return out


LAYERS = 8  # the HF model's layers


def _hf_layer(P: int) -> dict:
    """A tiny HF Llama (``LAYERS`` layers, hidden 64, 4/2 heads) with ``attn_implementation="tokenring"``: one
    forward over this rank's zigzag rows, the attention calls with the layers' glue around them (transformers
    absent: nothing)."""
    try:
        import transformers
    except ImportError:
        return {}
    import torch
    import torch.distributed as dist

    import tokenring.hf as thf
    from tokenring.layouts import local_positions

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="tokenring").eval()
    thf.configure(group=dist.group.WORLD)
    pos = local_positions(S_LOCAL * P, P, dist.get_rank(), "zigzag")
    ids = torch.randint(3, 100, (1, S_LOCAL * P))[:, pos]

    def forward():
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos[None])

    # decode: a sharded prefill of CACHE rows per rank, then one token per call over the ShardedCache (this
    # rank's rows grow by about 1/P per call); beside it the same weights in one process (SDPA) over a
    # DynamicCache cut back to CACHE rows after each call: a layer's glue and gather against none
    torch.manual_seed(0)
    single = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    single.load_state_dict(model.state_dict())
    prompt = torch.randint(3, 100, (1, CACHE * P))
    with torch.no_grad():
        sharded = thf.prefill(model, prompt)
        alone = single(input_ids=prompt[:, :CACHE], use_cache=True).cache
    last, step = prompt[:, -1:], [0]

    def decode():
        with torch.no_grad():
            model(input_ids=last, position_ids=torch.full((1, 1), CACHE * P + step[0]), cache=sharded, use_cache=True)
        step[0] += 1

    def decode_alone():
        with torch.no_grad():
            single(input_ids=last, position_ids=torch.full((1, 1), CACHE), cache=alone, use_cache=True)
        alone.crop(-1)  # (back to CACHE rows)

    return {
        f"HF Llama forward ({LAYERS} layers, {S_LOCAL} rows per rank)": forward,
        f"HF Llama decode step ({LAYERS} layers, {CACHE}+ cached rows per rank)": decode,
        f"the same decode step in one process (SDPA, {CACHE} cached rows)": decode_alone,
    }


def _timed(variants: dict, rounds: int, calls: int) -> dict:
    """Every round's microseconds per call of each variant, after a warm-up (plans, caches, agreements)."""
    for fn in variants.values():
        for _ in range(20):
            fn()
    kept = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            kept[name].append((time.perf_counter() - t0) / calls * 1e6)
    return kept


def _gloo_rank(rank: int, P: int, rounds: int, calls: int) -> dict:
    """One gloo rank's timings (:func:`_timed`; the HF model left out)."""
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    return _timed(_variants(P, True, hf=False), rounds, calls)


def walk(P: int = 4) -> dict:
    """The modules of tokenring that one warm ``attention(..., strategy="ring")`` forward passes through, in
    order (a profile hook's calls and returns, consecutive frames of one module counted once): the stays, and
    the modules entered more than once."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tokenring

    if not dist.is_initialized():
        dist.init_process_group(backend="fake", store=FakeStore(), rank=1, world_size=P)
    q, k, v = torch.randn(B, S_LOCAL, H, D), torch.randn(B, S_LOCAL, HKV, D), torch.randn(B, S_LOCAL, HKV, D)
    for _ in range(3):
        tokenring.attention(q, k, v, causal=True, strategy="ring")
    root = os.path.dirname(tokenring.__file__)
    seen: list[str] = []
    down: list[str] = []  # the modules on the call stack when the first kernel call begins, outermost first
    kdir = os.path.join(root, "kernels")

    def hook(frame, event, arg):
        code = frame.f_code
        if event == "call" and not down and code.co_name == "forward" and code.co_filename.startswith(kdir):
            f = frame
            while f is not None:
                if f.f_code.co_filename.startswith(root):
                    down.insert(0, f"{os.path.relpath(f.f_code.co_filename, root)}:{f.f_code.co_name}")
                f = f.f_back
        if event in ("call", "return"):
            f = frame.f_back if event == "return" else frame  # a return lands in the caller
            path = f.f_code.co_filename if f is not None else ""
            if path.startswith(root):
                mod = os.path.relpath(path, root)
                if not seen or seen[-1] != mod:
                    seen.append(mod)

    sys.setprofile(hook)
    try:
        tokenring.attention(q, k, v, causal=True, strategy="ring")
    finally:
        sys.setprofile(None)
    again = sorted({m for m in seen if seen.count(m) > 1})
    mods = [m for i, m in enumerate(x.split(":")[0] for x in down) if i == 0 or m != down[i - 1].split(":")[0]]
    twice = sorted({m for m in mods if mods.count(m) > 1})  # (consecutive frames of one module: one stay)
    return dict(stays=len(seen), path=seen, entered_again=again, down=down, down_twice=twice)


def child(P: int, rounds: int, calls: int, quick: bool, backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "gloo":  # P local gloo ranks on loopback; a round's time is its slowest rank's
        import host_overhead

        from tokenring.tools.launch import spawn

        every = spawn(host_overhead._gloo_rank, P, rounds, calls)
        print(json.dumps({name: [max(r[name][i] for r in every) for i in range(rounds)] for name in every[0]}))
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    # The fake group fills no receive buffer: kernels then read whatever memory held, denormals included, which
    # cost the CPU 5-10x per kernel call (the floor's flash calls took 200 us instead of 20). Flushed, every
    # variant computes at the same speed whatever its buffers hold.
    torch.set_flush_denormal(True)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=1, world_size=P)
    print(json.dumps(_timed(_variants(P, quick), rounds, calls)))


def _commit(path: str) -> str:
    out = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _walks(versions: dict, out: str) -> int:
    """:func:`walk` per version, each in a process of its own; writes ``out``.{md,json}."""
    call = 'attention(q, k, v, causal=True, strategy="ring")'
    lines = [
        "# The walk of q through one call",
        "",
        f"Command: `.venv/bin/python bench/host_overhead.py --walk --before DIR`. One warm `{call}` at P=4 on the "
        "fake process group: the modules of tokenring its frames stay in, in order (a profile hook's calls and "
        "returns; a module entered again counts again).",
        "",
    ]
    walks = {}
    for version, path in versions.items():
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([path or ROOT, HERE]))
        res = subprocess.run([sys.executable, __file__, "--walk-child"], env=env, check=True, capture_output=True)
        walks[version] = w = json.loads(res.stdout.decode().strip().splitlines()[-1])
        commit = _commit(path or ROOT)
        lines += [f"- {version} ({commit}): {w['stays']} stays; modules entered again: "
                  f"{', '.join(w['entered_again']) or 'none'}.",
                  f"  The way down (the call stack when the first kernel call begins): {' > '.join(w['down'])}; "
                  f"modules on it twice: {', '.join(w['down_twice']) or 'none'}.",
                  f"  Path: {' > '.join(w['path'])}"]  # fmt: skip
    from _results import write

    write(out, {"walk": walks}, lines)
    return 0


def _floor_of(name: str) -> str:
    """The floor a call is set against: decode steps against the minimal decode step, forward+backward calls
    against the forward+backward ring loop, the rest against the forward ring loop."""
    if name.startswith("decode") or name == FLOOR_DECODE:
        return FLOOR_DECODE
    return FLOOR_FB if "forward+backward" in name else FLOOR


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--backend",
        choices=("fake", "gloo"),
        default="fake",
        help="fake: PyTorch's fake process group, rank 1 of P in one process (host time alone); gloo: P local "
        "gloo ranks on loopback (what a call costs with real messages; writes host_overhead_gloo)",
    )
    ap.add_argument(
        "--before",
        metavar="DIR",
        help="a checkout of an earlier commit: its tokenring is timed too, in child processes alternating with "
        "this one's (the floor is measured in both)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="child processes per version and P, alternating")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--walk", action="store_true", help="only the walk of q through a call (host_overhead_walk)")
    ap.add_argument("--walk-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.rounds, a.calls, a.quick, a.backend)
        return 0
    if a.walk_child:
        print(json.dumps(walk()))
        return 0
    versions = {"now": None, **({"before": os.path.abspath(a.before)} if a.before else {})}
    if a.walk:
        return _walks(versions, a.out or os.path.join(HERE, "results", "host_overhead_walk"))
    gloo = a.backend == "gloo"
    a.out = a.out or os.path.join(HERE, "results", "host_overhead_gloo" if gloo else "host_overhead")
    if a.quick:
        a.ranks, a.rounds, a.calls = [4], 3, 50
    results: dict = {}  # version -> P -> call -> every round's us per call
    for P in a.ranks:
        for _ in range(a.repeats):
            for version, path in versions.items():
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([path or ROOT, HERE]))
                cmd = [sys.executable, __file__, "--child", str(P), "--rounds", str(a.rounds), "--calls", str(a.calls)]
                cmd += ["--backend", a.backend]
                text = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                for name, us in json.loads(text.strip().splitlines()[-1]).items():
                    results.setdefault(version, {}).setdefault(P, {}).setdefault(name, []).extend(us)
        print(f"P={P} done", file=sys.stderr)
    lines = [
        f"# Time per call on {'local gloo ranks (loopback)' if gloo else 'the fake process group (host time)'}",
        "",
        f"Command: `.venv/bin/python bench/host_overhead.py{' --quick' if a.quick else ''}"
        f"{' --backend gloo' if gloo else ''} --ranks {' '.join(map(str, a.ranks))} --rounds {a.rounds} --calls "
        f"{a.calls}{' --before DIR' if a.before else ''}`. Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, one thread per process, "
        + (
            "P gloo ranks on 127.0.0.1 sharing the cores (a round's time: its slowest rank's)"
            if gloo
            else "PyTorch's fake process group (no data moves)"
        )
        + f". Shapes: B={B}, {S_LOCAL} rows per rank, {H}/{HKV} heads, "
        f"d={D}, float32, causal; decode: 1 new token over {CACHE} cached rows per rank. Microseconds per call, "
        f"median (min-max) of {a.repeats} processes x {a.rounds} interleaved rounds of {a.calls} calls; ratio: "
        f"median over the floor's in the same processes (forward+backward rows: the forward+backward floor's; "
        f"decode rows: the minimal decode step's)."
        + (
            f" Before: the tokenring of `{a.before}` (commit {_commit(a.before)}), its processes alternating with "
            f"this checkout's (commit {_commit(HERE)})."
            if a.before
            else ""
        ),  # fmt: skip
        "",
        "| P | call | " + " | ".join(f"{v}: us per call | {v}: / floor" for v in versions) + " |",
        "|---|---|" + "---|---|" * len(versions),
    ]
    for P in a.ranks:
        for name in results["now"][P]:
            cells = []
            for version in versions:
                kept = results[version][P]
                us, floor = kept[name], statistics.median(kept[_floor_of(name)])
                m = statistics.median(us)
                cells.append(f"{m:.0f} ({min(us):.0f}-{max(us):.0f}) | {m / floor:.2f}x")
            lines.append(f"| {P} | {name} | " + " | ".join(cells) + " |")
    from _results import write

    write(a.out, {"shapes": dict(B=B, s=S_LOCAL, H=H, Hkv=HKV, d=D, cache=CACHE), "rounds": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
