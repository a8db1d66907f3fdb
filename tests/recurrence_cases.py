"""Per-rank bodies for tests/test_recurrence.py: each recurrent kind sharded over the ranks vs the same kernel run
on the whole sequence in one process (per document when packed), forward and backward."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokenring import recurrence
from tokenring.layouts import group_info, local_positions


def seq_delta(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kw):
    """The gated delta rule (KDA when ``g`` has a last dim of ``dk``) token by token, in the inputs' dtype."""
    B, s, Hk, dk = k.shape
    Hv, dv = v.shape[-2:]
    q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    q = q * dk**-0.5
    S = q.new_zeros(B, Hv, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(s):
        decay = g[:, t].exp()
        S = S * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), (S if output_final_state else None)


def seq_ssd(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
            dt_limit=(0.0, float("inf")), return_final_states=False, **kw):  # fmt: skip
    """Mamba2's scan token by token, in the inputs' dtype."""
    b, s, h, p = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
    S = x.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(s):
        S = S * (dt[:, t] * A).exp()[..., None, None] + dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None]
        y = torch.einsum("bhpn,bhn->bhp", S, C[:, t])
        ys.append(y + D[:, None] * x[:, t] if D is not None else y)
    y = torch.stack(ys, 1)
    return (y, S) if return_final_states else y


def _kernels(name):
    if name == "seq_delta":
        return seq_delta
    if name in ("seq_ssd", ""):
        return seq_ssd  # ("": the convolution, which takes no kernel)
    from transformers.models.bamba import modeling_bamba
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.qwen3_next import modeling_qwen3_next

    return {
        "gdn": modeling_qwen3_next.torch_chunk_gated_delta_rule,
        "kda": modeling_kimi_linear.chunk_kimi_delta_attention,
        "mamba2": modeling_bamba.mamba2_chunk_scan,
    }[name]


def _docs(S: int, P: int, layout: str, ndocs: int, seed: int) -> tuple[int, ...]:
    """Document starts (0 first): for zigzag_docs, lengths that are multiples of 2P."""
    if ndocs <= 1:
        return (0,)
    rng = np.random.default_rng(seed)
    unit = 2 * P if layout == "zigzag_docs" else 1
    cuts = sorted(rng.choice(np.arange(1, S // unit), size=ndocs - 1, replace=False).tolist())
    return (0, *[c * unit for c in cuts])


def _per_doc(fn, starts, S, tensors, dim=1):
    """``fn`` run on each document's rows of ``tensors``, outputs concatenated (the one-process reference)."""
    bounds = [*starts, S]
    outs = [fn(*[t.narrow(dim, a, b - a) for t in tensors]) for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat(outs, dim=dim)


def case(rank, P, kind, layout, S, ndocs, dtype_name, kernel_name, seed=0):
    """Max abs errors of one sharded kind vs one process, forward and backward (every input and parameter)."""
    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD if P > 1 else None
    rank, P = group_info(group)
    starts = _docs(S, P, layout, ndocs, seed)
    plan = recurrence.plan_for(S, P, rank, layout, starts)
    mine = local_positions(S, P, rank, layout, cu_seqlens=(*starts, S))
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    Bsz = 2
    kernel = _kernels(kernel_name)
    if kind in ("delta", "kda"):
        Hk, Hv, dk, dv = 1, 2, 5, 3
        full = dict(
            q=rnd(Bsz, S, Hk, dk), k=rnd(Bsz, S, Hk, dk), v=rnd(Bsz, S, Hv, dv),
            g=-F.softplus(rnd(Bsz, S, Hv, dk) if kind == "kda" else rnd(Bsz, S, Hv)) * 0.5,
            beta=torch.sigmoid(rnd(Bsz, S, Hv)),
        )  # fmt: skip
        params = {}
        names = list(full)

        def ref(**t):
            return _per_doc(lambda *x: kernel(*x, use_qk_l2norm_in_kernel=True)[0], starts, S, [t[n] for n in names])

        def sharded(**t):
            o, _ = recurrence.delta_rule(kernel, plan, group, *[t[n] for n in names], use_qk_l2norm_in_kernel=True)
            return o
    elif kind == "ssd":
        h, p, g, n = 4, 3, 2, 5
        full = dict(x=rnd(Bsz, S, h, p), dt=rnd(Bsz, S, h), B=rnd(Bsz, S, g, n), C=rnd(Bsz, S, g, n))
        params = dict(A=-torch.rand(h, generator=gen, dtype=torch.float64).to(dtype) - 0.1, D=rnd(h), dt_bias=rnd(h))
        names = ["x", "dt", "B", "C"]
        kw = dict(chunk_size=4, dt_softplus=True, dt_limit=(0.0, 5.0))

        def ref(**t):
            def one(x, dt, B, C):
                return kernel(x, dt, t["A"], B, C, D=t["D"], dt_bias=t["dt_bias"], **kw)

            return _per_doc(one, starts, S, [t[n] for n in names])

        def sharded(**t):
            return recurrence.ssd(
                kernel, plan, group, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["dt_bias"], **kw
            )
    elif kind == "conv":
        Cdim, K = 4, 4
        weight = rnd(Cdim, 1, K)
        full = dict(x=rnd(Bsz, Cdim, S))
        params = dict(w=weight, bias=rnd(Cdim))
        names = ["x"]

        def conv(x, w, bias):
            return F.silu(F.conv1d(x, w, bias, padding=K - 1, groups=Cdim)[..., : x.shape[-1]])

        def ref(**t):
            return _per_doc(lambda x: conv(x, t["w"], t["bias"]), starts, S, [t["x"]], dim=-1)

        def sharded(**t):
            return recurrence.causal_conv(lambda x: conv(x, t["w"], t["bias"]), plan, group, t["x"], K - 1)
    else:
        raise ValueError(kind)

    seq_dim = -1 if kind == "conv" else 1
    leaves = {k: v.clone().requires_grad_(True) for k, v in {**full, **params}.items()}
    want = ref(**leaves)
    w = rnd(*want.shape)
    (want * w).sum().backward()
    ref_grads = {k: v.grad for k, v in leaves.items()}

    local = {
        k: (v.index_select(seq_dim, mine) if k in full else v).clone().requires_grad_(True)
        for k, v in {**full, **params}.items()
    }
    got = sharded(**local)
    (got * w.index_select(seq_dim, mine)).sum().backward()
    errs = {"out": (got - want.detach().index_select(seq_dim, mine)).abs().max().item()}
    for k, v in local.items():
        grad = v.grad
        if k in params and P > 1:
            grad = grad.clone()
            dist.all_reduce(grad)
        expect = ref_grads[k].index_select(seq_dim, mine) if k in full else ref_grads[k]
        errs[f"d{k}"] = (grad - expect).abs().max().item()
    scale = max(want.abs().max().item(), 1.0)
    return {"errs": errs, "scale": scale, "segments": len(plan.segments)}
