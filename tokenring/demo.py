"""``tokenring demo``: 4 local ranks run every strategy on one causal attention layer of a long sequence,
check the result against single-process attention and print time per call and max error.

    python -m tokenring demo [--seq 16384] [--ranks 4] [--heads 8] [--kv-heads 8] [--head-dim 64]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import tokenring
from tokenring.launch import spawn

STRATEGIES = ("token_ring", "ring", "ulysses")


def _inputs(S: int, H: int, Hkv: int, d: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, S, h, d, generator=gen) for h in (H, Hkv, Hkv)]


def _rank(rank: int, P: int, S: int, H: int, Hkv: int, d: int, repeats: int) -> dict:
    q, k, v = (tokenring.shard(t, dim=1, layout="zigzag") for t in _inputs(S, H, Hkv, d))
    res = {}
    for name in STRATEGIES:
        if name == "ulysses" and H % P:
            continue
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenring demo", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384, help="global sequence length (tokens)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    print(f"causal attention layer: S={a.seq} tokens, H={a.heads}, Hkv={a.kv_heads}, d={a.head_dim}, float32, "
          f"{a.ranks} local gloo ranks (zigzag layout), CPU")
    res = spawn(_rank, a.ranks, a.seq, a.heads, a.kv_heads, a.head_dim, a.repeats)[0]
    best = min(r["time"] for k, r in res.items() if k != "single-process")
    print(f"{'strategy':<16}{'time/call':>12}{'vs best':>10}{'max |err|':>12}")
    for name, r in res.items():
        print(f"{name:<16}{r['time'] * 1e3:>10.1f}ms{r['time'] / best:>9.2f}x{r['max_err']:>12.2e}")
    worst = max(r["max_err"] for r in res.values())
    ok = worst < 1e-4
    print(f"all strategies match single-process attention: {'yes' if ok else 'NO'} (max |err| {worst:.2e}, "
          f"float32 tolerance 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
