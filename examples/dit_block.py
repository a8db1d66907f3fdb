"""A DiT-style (diffusion transformer) block over image patch tokens, sequence-parallel, non-causal.

Every token attends to every token (``causal=False``), so the plain ``contiguous`` layout is balanced: rank ``r``
holds patches ``[r*s, (r+1)*s)``. The block is the DiT one (Peebles & Xie, 2023): adaLN-Zero modulation from
the timestep/class embedding, multi-head self-attention, MLP; everything except attention is per token, so only
attention needs the other ranks. Forward and backward are checked against the same block in one process.

    python examples/dit_block.py [--tokens 4096] [--ranks 4] [--strategy token_ring]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tokenring
from tokenring.tools.launch import spawn


class DiTBlock(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 8, mlp_ratio: float = 4.0, strategy: str = "auto"):
        super().__init__()
        self.heads, self.strategy = heads, strategy
        self.sequence_parallel = True  # False: plain single-process attention (the reference)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, s, D = x.shape
        q, k, v = self.qkv(x).view(B, s, 3, self.heads, D // self.heads).unbind(2)  # (B, s, H, d) each
        if self.sequence_parallel:
            out = tokenring.attention(q, k, v, causal=False, strategy=self.strategy, layout="contiguous")
        else:
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        return self.proj(out.reshape(B, s, D))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``x``: (B, s, D) this rank's patch tokens; ``c``: (B, D) conditioning (timestep + class), replicated."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + gate1 * self.attention(self.norm1(x) * (1 + scale1) + shift1)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


def make(S: int, dim: int, strategy: str):
    torch.manual_seed(0)
    block = DiTBlock(dim, strategy=strategy)
    with torch.no_grad():  # adaLN-Zero starts at zero (the block is the identity); perturb it so attention counts
        for p in block.adaLN.parameters():
            p.normal_(0, 0.05)
        block.qkv.weight.mul_(4)  # sharper attention than the default init: a stronger check
    gen = torch.Generator().manual_seed(1)
    return block, torch.randn(2, S, dim, generator=gen), torch.randn(2, dim, generator=gen)


def run(rank: int, P: int, S: int, dim: int = 256, strategy: str = "auto") -> dict:
    """Forward + backward of the block on this rank's tokens (loss: global mean of y^2); rank 0 compares output,
    input gradient and parameter gradients with the same block in one process."""
    block, x, c = make(S, dim, strategy)
    x_local = tokenring.shard(x, dim=1, layout="contiguous").clone().requires_grad_()
    t0 = time.perf_counter()
    y = block(x_local, c)
    (y.square().sum() / y.new_tensor(x.numel())).backward()  # this rank's share of the global mean
    for p in block.parameters():  # sum the shares' gradients
        torch.distributed.all_reduce(p.grad)
    y_full = tokenring.gather(y.detach(), dim=1, layout="contiguous")
    with torch.no_grad():  # the attention sublayer alone (the residual stream dwarfs it in y)
        a_full = tokenring.gather(block.attention(block.norm1(x_local)), dim=1, layout="contiguous")
    dx_full = tokenring.gather(x_local.grad, dim=1, layout="contiguous")
    res = dict(time=time.perf_counter() - t0)
    if rank == 0:
        ref, _, _ = make(S, dim, strategy)
        ref.sequence_parallel = False
        xr = x.clone().requires_grad_()
        yr = ref(xr, c)
        yr.square().mean().backward()
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        with torch.no_grad():
            a_ref = ref.attention(ref.norm1(x))
        res.update(
            out=rel(y_full, yr.detach()),
            attn=rel(a_full, a_ref),
            dx=rel(dx_full, xr.grad),
            grad=max(rel(p.grad, q.grad) for p, q in zip(block.parameters(), ref.parameters())),
        )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="patch tokens per image (64x64 latent, patch 1)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--strategy", default="auto")
    a = ap.parse_args(argv)
    r = spawn(run, a.ranks, a.tokens, a.dim, a.strategy)[0]
    print(
        f"DiT block, batch 2 x {a.tokens} tokens, dim {a.dim}, 8 heads, non-causal, {a.ranks} ranks "
        f"({a.strategy}): forward+backward {r['time']:.2f} s"
    )
    print(
        f"relative difference to one process: attention output {r['attn']:.1e}, block output {r['out']:.1e}, "
        f"input gradient {r['dx']:.1e}, "
        f"parameter gradients {r['grad']:.1e}"
    )
    ok = max(r["attn"], r["out"], r["dx"], r["grad"]) < 1e-4
    print("matches single process:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
