"""Rank-side functions for tests/test_context.py: plain PyTorch models whose SDPA calls run sequence-parallel
under ``tokenring.context_parallel``, against the same model in one process (float64).

``TitanLlama`` is written the way TorchTitan writes its Llama: rotary embeddings from a precomputed complex
``freqs_cis`` buffer sliced to the local length inside the model (sharded as a context-parallel buffer, so each
rank gets its tokens' rotations), ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` called by
the attention module, SwiGLU feed-forward, RMSNorm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tokenring


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    return torch.polar(torch.ones(end, dim // 2, dtype=torch.float64), torch.outer(t, freqs))  # (S, d/2) complex


def apply_rotary_emb(xq, xk, freqs_cis):
    """(B, s, H, d) queries and keys rotated by ``freqs_cis`` (s, d/2)."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[None, :, None, :]
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x, freqs_cis):
        B, s, _ = x.shape
        q = self.wq(x).view(B, s, self.heads, self.hd)
        k = self.wk(x).view(B, s, self.kv_heads, self.hd)
        v = self.wv(x).view(B, s, self.kv_heads, self.hd)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(B, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads)
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama(nn.Module):
    def __init__(self, vocab=128, dim=64, layers=2, heads=4, kv_heads=2, max_seq=512):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // heads, max_seq), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]  # the local length: a sharded buffer gives this rank's rows
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


class DiTBlock(nn.Module):
    """adaLN-Zero DiT block over patch tokens: non-causal multi-head SDPA."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        B, s, D = x.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        y = self.norm1(x) * (1 + sc1) + sh1
        q, k, v = self.qkv(y).view(B, s, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, s, D)
        x = x + g1 * self.proj(a)
        return x + g2 * self.mlp(self.norm2(x) * (1 + sc2) + sh2)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _sum_grads(model, P):
    for p in model.parameters():
        if p.grad is not None and P > 1:
            dist.all_reduce(p.grad)


def llama_step(rank: int, P: int, S: int, strategy: str = "auto") -> dict:
    """One SGD step of TitanLlama (float64) under context_parallel vs one process: loss, every gradient, the
    parameters after the step, and the buffers restored to the whole sequence."""
    torch.manual_seed(0)
    model = TitanLlama(max_seq=S).double()  # as TorchTitan: freqs_cis covers the training length, sharded with it
    ref = TitanLlama(max_seq=S).double()
    ref.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 128, (2, S), generator=torch.Generator().manual_seed(1))
    labels = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=-100)  # shifted on the whole sequence
    n = int((labels != -100).sum())
    want_loss = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n
    want_loss.backward()
    freqs = model.freqs_cis.clone()
    ids, lab = tokens.clone(), labels.clone()
    with tokenring.context_parallel(buffers=[ids, lab, model.freqs_cis], seq_dims=[1, 1, 0], strategy=strategy):
        mine = len(tokenring.shard_positions(S, P, rank, "zigzag"))  # S // P when the layout splits S evenly
        assert ids.shape[1] == mine and model.freqs_cis.shape[0] == mine
        loss = F.cross_entropy(model(ids).flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum") / n
        loss.backward()
    total = loss.detach().clone()
    if P > 1:
        dist.all_reduce(total)
    _sum_grads(model, P)
    res = dict(
        loss=abs(total.item() - want_loss.item()) / want_loss.item(),
        grad=max(rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
        restored=bool(torch.equal(ids, tokens) and torch.equal(lab, labels) and torch.equal(model.freqs_cis, freqs)),
    )
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    res["params"] = max(rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return res


def dit_step(rank: int, P: int, S: int, strategy: str = "auto") -> dict:
    """A DiT block (non-causal) forward and backward under context_parallel vs one process (float64)."""
    torch.manual_seed(0)
    block = DiTBlock().double()
    x = torch.randn(2, S, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    c = torch.randn(2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gy = torch.randn(2, S, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    xr = x.clone().requires_grad_()
    block(xr, c).backward(gy)
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    xs, gys = x.clone(), gy.clone()
    with tokenring.context_parallel(buffers=[xs, gys], seq_dims=[1, 1], no_restore_buffers=[xs], strategy=strategy):
        xs.requires_grad_()
        y = block(xs, c)
        y.backward(gys)
        out = tokenring.gather(y.detach(), dim=1, layout="zigzag")
        dx = tokenring.gather(xs.grad, dim=1, layout="zigzag")
    _sum_grads(block, P)
    with torch.no_grad():
        ref = block(x, c)
    return dict(
        out=rel(out, ref),
        dx=rel(dx, xr.grad),
        grad=max(rel(p.grad, want[n]) for n, p in block.named_parameters()),
    )


def refused_mask(rank: int, P: int) -> str:
    """An SDPA call with a mask tensor inside the block: the ValueError's message (every rank)."""
    q = torch.randn(1, 2, 8, 16)
    try:
        with tokenring.context_parallel():
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    except ValueError as e:
        return str(e)
    return "not refused"


def flux_step(rank: int, P: int, n_img: int, n_txt: int) -> dict:
    """One denoising step of a tiny diffusers Flux transformer (joint text + image attention, rotary ids; float64)
    under context_parallel vs one process: the image tokens' prediction and every gradient. Non-causal attention
    over every token sees all keys whatever their order, so text and image tokens are each sharded alone."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    kw = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16)
    kw.update(num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    model = FluxTransformer2DModel(**kw).double()
    gen = torch.Generator().manual_seed(5)
    inputs = dict(
        hidden_states=torch.randn(1, n_img, 8, dtype=torch.float64, generator=gen),
        encoder_hidden_states=torch.randn(1, n_txt, 32, dtype=torch.float64, generator=gen),
        pooled_projections=torch.randn(1, 32, dtype=torch.float64, generator=gen),
        timestep=torch.tensor([0.5], dtype=torch.float64),
        img_ids=torch.randint(0, 16, (n_img, 3), generator=gen).double(),
        txt_ids=torch.zeros(n_txt, 3, dtype=torch.float64),
        return_dict=False,
    )
    want = model(**inputs)[0]
    want.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    names = ["hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"]
    local = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with tokenring.context_parallel(buffers=[local[k] for k in names], seq_dims=[1, 1, 0, 0], layout="contiguous"):
        out = model(**local)[0]
        (out.square().sum() / want.numel()).backward()
        full = tokenring.gather(out.detach(), dim=1, layout="contiguous", seq_len=n_img)
    _sum_grads(model, P)
    return dict(
        out=rel(full, want.detach()),
        grad=max(rel(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads),
    )


def compiled_dit(rank: int, P: int, S: int) -> dict:
    """The DiT block under ``torch.compile(fullgraph=True)`` inside context_parallel (no graph break allowed),
    forward and backward, vs one process (float32)."""
    torch.manual_seed(0)
    block = DiTBlock()
    x = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(2))
    c = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    ref = block(x, c)
    ref.square().mean().backward()
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    torch._dynamo.reset()
    fast = torch.compile(block, fullgraph=True)
    xs = x.clone()
    with tokenring.context_parallel(buffers=[xs], seq_dims=[1], no_restore_buffers=[xs]):
        y = fast(xs, c)
        (y.square().sum() / ref.numel()).backward()
        out = tokenring.gather(y.detach(), dim=1, layout="zigzag")
    _sum_grads(block, P)
    return dict(out=rel(out, ref.detach()), grad=max(rel(p.grad, want[n]) for n, p in block.named_parameters()))


def vit_step(rank: int, P: int, family: str, image: int, patch: int) -> dict:
    """A tiny Hugging Face ViT / DeiT encoder (float64, sdpa attention, no dropout) under context_parallel vs one
    process: its ``(image / patch)^2`` patch tokens plus the class (and distillation) tokens, a count that need
    not split evenly, are sharded after the embeddings (a buffer of the block); the encoder's output, every
    gradient (the embeddings' through the gathered input gradient) on the scale of the largest, and the key
    bias's gradient, zero in exact arithmetic."""
    import transformers

    cfg_cls, model_cls = {"vit": ("ViTConfig", "ViTModel"), "deit": ("DeiTConfig", "DeiTModel")}[family]
    cfg = getattr(transformers, cfg_cls)(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=image,
        patch_size=patch, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg, add_pooling_layer=False).double()
    model.eval()  # no dropout anywhere (the configuration's are 0 too)
    pixels = torch.randn(2, 3, image, image, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(h):  # the model's forward after its embeddings (no attention mask)
        for layer in model.layers:
            h = layer(h, None)
        return model.layernorm(h)

    h = model.embeddings(pixels)
    want = run(h)
    gy = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want.backward(gy)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    h = model.embeddings(pixels)
    x, g = h.detach().clone(), gy.clone()
    with tokenring.context_parallel(buffers=[x, g], seq_dims=[1, 1], layout="contiguous"):
        x.requires_grad_()
        y = run(x)
        y.backward(g)
        out = tokenring.gather(y.detach(), dim=1, layout="contiguous", seq_len=h.shape[1])
        dx = tokenring.gather(x.grad, dim=1, layout="contiguous", seq_len=h.shape[1])
    _sum_grads(model, P)  # the encoder's shares of this rank's rows; the embeddings' not yet
    h.backward(dx)  # every rank: the whole input gradient into the embeddings (already summed over the rows)
    # Softmax ignores a shift shared by every key, so the key projection's bias has a zero gradient: what both
    # runs give for it is rounding (1e-17), hence every gradient is compared on the model's largest gradient's scale.
    scale = max(g.abs().max() for g in grads.values())
    got = dict(model.named_parameters())
    return dict(
        tokens=h.shape[1],
        out=rel(out, want.detach()),
        grad=max(((got[n].grad - g).abs().max() / scale).item() for n, g in grads.items()),
        key_bias=max(
            (t.abs().max() / scale).item() for n, g in grads.items() if "k_proj.bias" in n for t in (g, got[n].grad)
        ),
    )


def packed_auto_step(rank: int, P: int, S: int, cu: list[int], pick: str | None) -> dict:
    """A causal SDPA layer over packed documents under ``context_parallel(layout="auto", cu_seqlens=...)``
    (``pick``: the placement the chooser answers, else the cost model's) vs one process with the documents'
    block-causal mask (float64): the output gathered with ``layout="auto"``, the weights' gradient, and the
    placement the buffer was cut with."""
    from cases import forced_placement

    with forced_placement(pick):
        torch.manual_seed(0)
        proj = nn.Linear(16, 48).double()
        x = torch.randn(1, S, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

        def layer(h, mask=None):
            q, k, v = (t.transpose(1, 2) for t in proj(h).view(1, h.shape[1], 3, 2, 8).unbind(2))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            return y.transpose(1, 2).flatten(2)

        doc = torch.searchsorted(torch.tensor(cu), torch.arange(S), right=True)
        mask = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
        want = layer(x, mask)
        want.pow(2).sum().backward()
        ref = proj.weight.grad.clone()
        proj.zero_grad()
        xs = x.clone()
        placed = tokenring.layouts.resolve_layout("auto", S, P, cu)
        with tokenring.context_parallel(buffers=[xs], seq_dims=[1], layout="auto", cu_seqlens=cu):
            held = torch.equal(xs, tokenring.shard(x, 1, placed, cu_seqlens=cu))
            out = layer(xs)
            out.pow(2).sum().backward()
        got = tokenring.gather(out.detach(), 1, "auto", cu_seqlens=cu)
        grad = proj.weight.grad.clone()
        if P > 1:
            dist.all_reduce(grad)
        return dict(out=rel(got, want.detach()), grad=rel(grad, ref), placed=placed, held=held)
