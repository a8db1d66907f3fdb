"""One-shot GPU check (run on a lent CUDA machine): the CUDA kernel path and the single-device overhead.

    python bench/gpu_check.py --out bench/results/gpu_check.json

1. Correctness of ``tokenring.kernels`` on CUDA: bf16, d=128, H=32, local lengths 2K and 8K, causal and not:
   block forward (flash op) and the chunked backward against a float32 math reference (max abs error).
2. Overhead at P=1: ``tokenring.attention`` (no process group: plain SDPA path) and the schedule machinery
   (token_ring forward/backward on a one-rank gloo group: kernel + merge + bookkeeping) against
   ``F.scaled_dot_product_attention``, fwd and fwd+bwd, CUDA-event timed medians. Target: <= 5% for the
   public P=1 path.
3. Cost of one exact merge step (``merge_``) at each length, next to one block forward.
Everything is printed as a table and written as JSON; no assertion on timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring
from tokenring.kernels import block_backward, block_forward, math_forward
from tokenring.merge import merge_, new_accumulator
from tokenring.strategies import STRATEGIES
from tokenring.strategies.base import Config, ScheduledAttention


def timed(fn, repeats=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gpu_check.json")
    a = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = torch.device("cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)  # one-rank group: exercises the executor path
    rows = []
    H, d = 32, 128
    for n in (2048, 8192):
        for causal in (False, True):
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(1, n, H, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
            o, lse = block_forward(q, k, v, causal, d ** -0.5)
            o_ref, lse_ref = math_forward(q.float(), k.float(), v.float(), causal, d ** -0.5)
            dout = torch.randn_like(q)
            delta = (dout.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
            dq, dk, dv = block_backward(dout, q, k, v, lse, delta, causal, d ** -0.5)
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                                 is_causal=causal).transpose(1, 2)
            ref.backward(dout.float())
            err = dict(out=(o.float() - o_ref).abs().max().item(), lse=(lse - lse_ref).abs().max().item(),
                       dq=(dq - qr.grad).abs().max().item(), dk=(dk - kr.grad).abs().max().item(),
                       dv=(dv - vr.grad).abs().max().item())
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            t_api = timed(lambda: tokenring.attention(q, k, v, causal=causal, layout="contiguous"))
            cfg = Config(group=None, rank=0, P=1, causal=causal, layout="contiguous", scale=d ** -0.5)
            t_sched = timed(lambda: ScheduledAttention.apply(q, k, v, STRATEGIES["token_ring"], cfg))
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            qtg, ktg, vtg = (t.transpose(1, 2) for t in (qg, kg, vg))
            t_sdpa_fb = timed(lambda: F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=causal).sum().backward())
            t_sched_fb = timed(lambda: ScheduledAttention.apply(qg, kg, vg, STRATEGIES["token_ring"], cfg).sum().backward())
            acc_o, acc_lse = new_accumulator(1, n, H, d, q.dtype, dev)
            t_merge = timed(lambda: merge_(acc_o, acc_lse, o, lse))
            t_block = timed(lambda: block_forward(q, k, v, causal, d ** -0.5))
            rows.append(dict(n=n, H=H, d=d, dtype="bfloat16", causal=causal, max_abs_err=err,
                             sdpa_fwd_ms=t_sdpa, api_p1_fwd_ms=t_api, api_p1_overhead=t_api / t_sdpa - 1,
                             sched_p1_fwd_ms=t_sched, sched_p1_overhead=t_sched / t_sdpa - 1,
                             sdpa_fwdbwd_ms=t_sdpa_fb, sched_p1_fwdbwd_ms=t_sched_fb,
                             block_fwd_ms=t_block, merge_ms=t_merge))
            r = rows[-1]
            print(f"n={n:5d} causal={causal!s:5} err={max(err.values()):.2e} sdpa={t_sdpa:.3f}ms "
                  f"api={t_api:.3f}ms ({r['api_p1_overhead']:+.1%}) sched={t_sched:.3f}ms "
                  f"({r['sched_p1_overhead']:+.1%}) fwd+bwd sdpa={t_sdpa_fb:.3f} sched={t_sched_fb:.3f} "
                  f"merge={t_merge:.3f}ms block={t_block:.3f}ms")
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(info, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
