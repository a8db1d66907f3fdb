"""TokenRing in about 100 lines, for learning: the direct pass-Q schedule, forward and backward.

K and V never move. At step t every rank sends its queries to the rank t places ahead, attends the queries that
arrived from t places behind to its own K/V, and sends that partial (out, lse) straight back to their owner,
who merges it. Backward sends (Q, dO, lse, delta) the same way; dK/dV stay home, the partial dQ goes home.
MHA, the contiguous layout, plain matmuls in float32/64, no overlap of transfers and compute. The library
(tokenring.attention) adds GQA, zigzag, masks, fused kernels, overlap and error handling; the tests check this
file against it.   Run: torchrun --nproc-per-node 4 examples/token_ring_minimal.py
"""

import torch
import torch.distributed as dist


def exchange(send: list[torch.Tensor], to: int, frm: int) -> list[torch.Tensor]:
    """Send ``send`` to rank ``to`` and receive tensors shaped like them from rank ``frm``, all at once."""
    send = [t.contiguous() for t in send]
    got = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.irecv, g, frm) for g in got] + [dist.P2POp(dist.isend, t, to) for t in send]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got


def block(q, k, v, scale, mask):
    """One block: q (B, n, H, d) against k, v (B, m, H, d) -> out (B, n, H, d), lse (B, H, n)."""
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale  # (B, H, n, m)
    s = s.masked_fill(~mask, float("-inf"))  # mask (n, m): True where a query sees a key
    lse = torch.logsumexp(s, -1)  # (B, H, n); -inf on rows that see nothing
    p = torch.exp(s - lse.nan_to_num(neginf=0).unsqueeze(-1))  # a row that sees nothing gets p = 0
    return torch.einsum("bhnm,bmhd->bnhd", p, v), lse


def visible(n, q_owner, kv_owner, causal):
    """Which keys of ``kv_owner``'s shard each query of ``q_owner``'s shard sees (contiguous layout)."""
    if not causal or kv_owner < q_owner:
        return torch.ones(n, n, dtype=torch.bool)
    return torch.ones(n, n, dtype=torch.bool).tril() if kv_owner == q_owner else torch.zeros(n, n, dtype=torch.bool)


def merge(out, lse, o, l):
    """Merge partial (o, l) into (out, lse) in place: two softmaxes over disjoint keys, combined exactly."""
    new = torch.logaddexp(lse, l)
    safe = new.nan_to_num(neginf=0)
    w_old, w_new = (torch.exp(x - safe).transpose(1, 2).unsqueeze(-1) for x in (lse, l))  # (B, n, H, 1)
    out.mul_(w_old.nan_to_num(0)).add_(o * w_new.nan_to_num(0))
    lse.copy_(new)


def forward(q, k, v, causal, scale):
    r, P = dist.get_rank(), dist.get_world_size()
    n = q.shape[1]
    out, lse = block(q, k, v, scale, visible(n, r, r, causal))  # my queries on my keys first
    for t in range(1, P):
        ahead, behind = (r + t) % P, (r - t) % P
        (q_in,) = exchange([q], to=ahead, frm=behind)  # Q_behind arrives (B, n, H, d)
        o, l = block(q_in, k, v, scale, visible(n, behind, r, causal))  # its partial on my K/V
        o, l = exchange([o, l], to=behind, frm=ahead)  # mine comes home from `ahead`
        merge(out, lse, o, l)
    return out, lse


def backward(dout, q, k, v, out, lse, causal, scale):
    r, P = dist.get_rank(), dist.get_world_size()
    n = q.shape[1]
    delta = (dout * out).sum(-1).transpose(1, 2)  # (B, H, n): rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for t in range(P):
        ahead, behind = (r + t) % P, (r - t) % P
        rows = [q, dout, lse, delta]
        if t:
            rows = exchange(rows, to=ahead, frm=behind)  # (Q, dO, lse, delta) of `behind`
        qb, dob, lseb, deltab = rows
        mask = visible(n, behind, r, causal)
        p = torch.exp(
            (torch.einsum("bnhd,bmhd->bhnm", qb, k) * scale).masked_fill(~mask, float("-inf")) - lseb.unsqueeze(-1)
        )  # (B, H, n, m): softmax probabilities
        dv += torch.einsum("bhnm,bnhd->bmhd", p, dob)  # dK/dV of my keys stay here
        ds = p * (torch.einsum("bnhd,bmhd->bhnm", dob, v) - deltab.unsqueeze(-1))
        dk += torch.einsum("bhnm,bnhd->bmhd", ds, qb) * scale
        dq_part = torch.einsum("bhnm,bmhd->bnhd", ds, k) * scale  # the partial dQ of `behind`'s rows
        if t:
            (dq_part,) = exchange([dq_part], to=behind, frm=ahead)  # mine comes home
        dq += dq_part
    return dq, dk, dv


class TokenRingAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale) v over the sequence sharded contiguously across the ranks."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        scale = q.shape[-1] ** -0.5
        out, lse = forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*backward(dout, *ctx.saved_tensors, ctx.causal, ctx.scale), None)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, 256, 4, 64, requires_grad=True) for _ in range(3))
    out = TokenRingAttention.apply(q, k, v, True)
    out.sum().backward()
    print(f"rank {dist.get_rank()}: out {tuple(out.shape)}, |dq| {q.grad.norm():.3f}")
    dist.destroy_process_group()
