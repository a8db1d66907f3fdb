"""Sequence-parallel attention on GPUs under torchrun (NCCL), checked against one process in float64.

Every rank builds the same random full-sequence q, k, v (seeded, broadcast from rank 0), keeps its shard
(``tokenring.shard``), runs ``tokenring.attention`` forward + backward ``--iters`` times, gathers the output and
the gradients and compares them with ``F.scaled_dot_product_attention`` over the full sequence in float64.
The reference is spread over the ranks (each takes every P-th block of query rows; the key/value gradients are
summed), so the check also runs at long lengths. Rank 0 prints the error and the median time per iteration;
the exit status is 1 when max|error| / max|reference| exceeds the dtype's tolerance (float32 1e-4, bf16/fp16
3e-2). ``--no-check`` skips the reference.

One node, 8 GPUs:

    torchrun --standalone --nproc-per-node 8 examples/torchrun_attention.py --seq 131072 --causal

Two nodes of 8 GPUs (run on each node, N = 0 on the first and 1 on the second; HOST is the first node's
address, reachable from the other node):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank N --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/torchrun_attention.py --seq 131072 --causal

Environment variables users commonly need:

    NCCL_DEBUG=WARN             NCCL reports problems only (INFO: also which transport and interface it uses)
    NCCL_SOCKET_IFNAME=eth0     the interface NCCL bootstraps (and without InfiniBand sends) over; also
                                GLOO_SOCKET_IFNAME for gloo
    NCCL_IB_HCA=mlx5_0,mlx5_1   the InfiniBand adapters NCCL may use between nodes
    TOKENRING_TIMEOUT=600       seconds tokenring waits for any peer before raising an error that names it
                                (default 300); this script also gives it to init_process_group, whose timeout
                                bounds NCCL's operations
    TOKENRING_TOPOLOGY=ib-2x8   the interconnect the cost model behind strategy="auto" assumes: a preset
                                (h100-nvswitch-8, a10-pcie-4, ascend910b-mesh-8, mi300x-mesh-8, ib-2x8,
                                loopback), kind:RATE (mesh:200mbit) or a JSON/YAML file; default
                                h100-nvswitch-8 on CUDA, loopback on CPU (tokenring.set_topology overrides it)
    OMP_NUM_THREADS=4           torch threads per process on CPU runs (several ranks share the cores)

Without CUDA it runs on CPU with gloo. ``--backend gloo`` with CUDA keeps the tensors on the GPU (rank r on
GPU ``LOCAL_RANK % device_count``): gloo cannot send CUDA tensors point to point, so tokenring stages its
messages through host memory. NCCL needs one GPU per rank; gloo lets several ranks share one GPU, which is
slow but handy for debugging context parallelism on a single GPU.
The tests run this script as 2 processes with ``--init-method file:///tmp/...`` and gloo, so nothing listens
on the network.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}
REF_BLOCK_BYTES = 1 << 31  # float64 scores of one block of query rows in the reference


def setup(args: argparse.Namespace) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        device = torch.device("cpu")
    else:  # NCCL: one GPU per rank; gloo: ranks may share GPUs (tokenring stages messages through host memory)
        device = torch.device("cuda", local_rank if backend == "nccl" else local_rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=args.init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=tokenring.get_timeout()),
    )
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_errors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool, got: dict[str, torch.Tensor]
) -> dict[str, float]:
    """max|got - ref| / max|ref| for out, dq, dk, dv, ref = float64 SDPA over the full sequence. Each rank
    computes every P-th block of query rows (forward and backward); dk and dv are summed over the ranks."""
    rank, P = dist.get_rank(), dist.get_world_size()
    B, S, H, d = q.shape
    q, dout = (t.double().transpose(1, 2) for t in (q, dout))  # (B, H, S, d)
    k, v = (t.double().transpose(1, 2).requires_grad_() for t in (k, v))  # (B, Hkv, S, d)
    got = {name: t.double().transpose(1, 2) for name, t in got.items()}
    num = torch.zeros(4, dtype=torch.float64, device=q.device)  # max|got - ref| and max|ref| per tensor
    den = torch.zeros_like(num)
    rows = max(1, REF_BLOCK_BYTES // (8 * B * H * S))
    pos = torch.arange(S, device=q.device)
    for a in range(rank * rows, S, P * rows):
        b = min(a + rows, S)
        e = b if causal else S  # keys these rows can see
        qb = q[:, :, a:b].clone().requires_grad_()
        mask = pos[:e] <= pos[a:b, None] if causal else None
        o = F.scaled_dot_product_attention(qb, k[:, :, :e], v[:, :, :e], attn_mask=mask, enable_gqa=k.shape[1] != H)
        o.backward(dout[:, :, a:b])
        for i, (ref, name) in enumerate(((o.detach(), "out"), (qb.grad, "dq"))):
            num[i] = torch.maximum(num[i], (got[name][:, :, a:b] - ref).abs().max())
            den[i] = torch.maximum(den[i], ref.abs().max())
    for i, (t, name) in enumerate(((k, "dk"), (v, "dv"))):
        grad = t.grad if t.grad is not None else torch.zeros_like(t)  # no rows: nothing added
        dist.all_reduce(grad)
        num[2 + i], den[2 + i] = (got[name] - grad).abs().max(), grad.abs().max()
    dist.all_reduce(num, op=dist.ReduceOp.MAX)
    dist.all_reduce(den, op=dist.ReduceOp.MAX)
    return {name: (n / max(m, 1e-300)).item() for name, n, m in zip(("out", "dq", "dk", "dv"), num, den)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384, help="full sequence length (all ranks together)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA when fewer than --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, float32 on CPU")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--strategy", default="auto", help="auto, token_ring, ring, ulysses, ring_bidir, ...")
    ap.add_argument("--iters", type=int, default=5, help="timed forward+backward iterations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare with float64 SDPA over the full sequence",
    )
    ap.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="default: nccl when CUDA is available, else gloo (gloo with CUDA: ranks may share a GPU)",
    )
    ap.add_argument("--init-method", default="env://", help="env:// under torchrun; file:///path also works")
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error("--iters must be at least 1")

    device = setup(args)
    rank, P = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "float32")]
    layout = "zigzag" if args.causal else "contiguous"
    B, S, H, Hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim

    # the same full-sequence inputs on every rank, and this rank's shards of them
    gen = torch.Generator(device=device).manual_seed(args.seed)
    full = [torch.randn(B, S, h, d, generator=gen, device=device, dtype=dtype) for h in (H, Hkv, Hkv, H)]
    for t in full:
        dist.broadcast(t, src=0)  # identical even where GPUs of different models would draw differently
    q, k, v, dout = full
    ql, kl, vl = (tokenring.shard(t, dim=1, layout=layout).detach().clone().requires_grad_() for t in (q, k, v))
    dout_l = tokenring.shard(dout, dim=1, layout=layout)

    times = []
    for _ in range(args.iters):
        ql.grad = kl.grad = vl.grad = None
        sync(device)
        t0 = time.perf_counter()
        out = tokenring.attention(ql, kl, vl, causal=args.causal, strategy=args.strategy, layout=layout)
        out.backward(dout_l)
        sync(device)
        times.append(time.perf_counter() - t0)

    ok = True
    if rank == 0:
        chosen = tokenring.choose_strategy(
            H,
            Hkv,
            P,
            B=B,
            s=S // P,
            d=d,
            dtype=dtype,
            causal=args.causal,
            layout=layout,
            device_type=device.type,
            requested=args.strategy,
        )
        where = os.environ.get("MASTER_ADDR", args.init_method)
        print(
            f"{P} ranks ({dist.get_backend()}, {device.type}, rendezvous {where}): B={B} S={S} H={H} Hkv={Hkv} "
            f"d={d} {str(dtype).removeprefix('torch.')} causal={args.causal} strategy {args.strategy} -> {chosen}"
        )
        print(f"forward+backward: median {1e3 * statistics.median(times):.2f} ms/iter over {args.iters} iters")
    if args.check:
        got = dict(
            zip(
                ("out", "dq", "dk", "dv"),
                (tokenring.gather(t, dim=1, layout=layout) for t in (out.detach(), ql.grad, kl.grad, vl.grad)),
            )
        )
        err = reference_errors(q, k, v, dout, args.causal, got)
        ok = max(err.values()) <= TOLERANCE[dtype]
        if rank == 0:
            print(
                "check vs float64 SDPA (max|err| / max|ref|): "
                + ", ".join(f"{n} {e:.1e}" for n, e in err.items())
                + f"; max {max(err.values()):.1e}, tolerance {TOLERANCE[dtype]:.0e}: {'OK' if ok else 'FAILED'}"
            )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
