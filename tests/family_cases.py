"""Decoder families of the installed transformers, each as a tiny config, for the family sweep
(tests/test_families.py, bench/families.py): sharded with ``attn_implementation="tokenring"`` at P ranks, each
either equals transformers' own attention in one process (logits, loss, every gradient) or is refused with a
ValueError on every rank that names the layer type and the model. Nothing in between.

A family is a row of :data:`FAMILIES`: ``name -> (model_type, config overrides, reference attention)``.
"""

from __future__ import annotations

import torch

# hidden 64, 4 heads of 16 (GQA 4/2), 4 layers, vocab 128: small enough for CI, large enough that every layer
# kind of a hybrid appears (the overrides below place them)
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=512,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
WINDOW = 16  # sliding windows shorter than a rank's shard, so they cross ranks
LINEAR = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
GDN = dict(
    layer_types=LINEAR,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_n_groups=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
)
NO_HEAD_DIM = dict(head_dim=None)  # families whose config derives head_dim (a property) from the hidden size

FAMILIES: dict[str, tuple[str, dict, str]] = {
    # dense
    "llama": ("llama", {}, "sdpa"),
    "qwen2": ("qwen2", dict(use_sliding_window=False), "sdpa"),
    "qwen3": ("qwen3", {}, "sdpa"),
    "mistral": ("mistral", dict(sliding_window=WINDOW), "sdpa"),
    "ministral": ("ministral", dict(sliding_window=WINDOW), "sdpa"),
    "gemma": ("gemma", {}, "sdpa"),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW), "eager"),  # attention logit soft-capping: refused
    "gemma2 (soft-capping off)": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=None), "eager"),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, sliding_window_pattern=2), "sdpa"),
    "phi3": ("phi3", {}, "sdpa"),
    "phi": ("phi", NO_HEAD_DIM, "sdpa"),
    "olmo": ("olmo", {}, "sdpa"),
    "olmo2": ("olmo2", {}, "sdpa"),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW), "sdpa"),
    "granite": ("granite", {}, "sdpa"),
    "starcoder2": ("starcoder2", dict(sliding_window=None), "sdpa"),
    "cohere": ("cohere", {}, "sdpa"),
    "cohere2": ("cohere2", dict(sliding_window=WINDOW), "sdpa"),
    "glm": ("glm", {}, "sdpa"),
    "glm4": ("glm4", {}, "sdpa"),
    "stablelm": ("stablelm", NO_HEAD_DIM, "sdpa"),
    "nemotron": ("nemotron", {}, "sdpa"),
    "exaone4": ("exaone4", dict(sliding_window=WINDOW), "sdpa"),
    "smollm3": ("smollm3", {}, "sdpa"),
    "helium": ("helium", {}, "sdpa"),
    "seed_oss": ("seed_oss", dict(residual_dropout=0.0), "sdpa"),  # dropout draws differ by design
    # MoE
    "mixtral": ("mixtral", MOE, "sdpa"),
    "qwen2_moe": ("qwen2_moe", {**MOE, "shared_expert_intermediate_size": 32}, "sdpa"),
    "qwen3_moe": ("qwen3_moe", MOE, "sdpa"),
    "granitemoe": ("granitemoe", MOE, "sdpa"),
    "glm4_moe": ("glm4_moe", {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1}, "sdpa"),
    # attention sinks, alternating sliding / full layers
    "gpt_oss": ("gpt_oss", {**MOE, "sliding_window": WINDOW, "head_dim": 16}, "eager"),
    # MLA: q/k head dim 24 (16 + 8 rotary), v head dim 16
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            kv_lora_rank=32,
            q_lora_rank=48,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
        ),
        "sdpa",
    ),
    # hybrids: a sequence mixer beside attention
    "qwen3_next": ("qwen3_next", {**MOE, **GDN, "shared_expert_intermediate_size": 32}, "sdpa"),
    "qwen3_5": ("qwen3_5_text", GDN, "sdpa"),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**MOE, **GDN, "shared_expert_intermediate_size": 32}, "sdpa"),
    "olmo_hybrid": ("olmo_hybrid", GDN, "sdpa"),
    "falcon_h1": ("falcon_h1", {**MAMBA, "mamba_d_ssm": 128}, "sdpa"),
    "bamba": ("bamba", {**MAMBA, "attn_layer_indices": [1, 3]}, "sdpa"),
    "granitemoehybrid": (
        "granitemoehybrid",
        {**MAMBA, **MOE, "layer_types": ["mamba", "attention", "mamba", "attention"]},
        "sdpa",
    ),
    "jamba": ("jamba", {**MOE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2}, "sdpa"),
    "nemotron_h": (  # its Mamba2 sizes go by other names
        "nemotron_h",
        {
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "chunk_size": 8,
            "layers_block_type": ["mamba", "attention", "mlp", "attention"],
        },
        "sdpa",
    ),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention", "conv", "full_attention"]), "sdpa"),
    "minimax": ("minimax", {**MOE, "layer_types": LINEAR}, "sdpa"),
    "kimi_linear": (  # KDA (a delta rule with a decay per key channel) beside MLA
        "kimi_linear",
        {
            **MOE,
            "layer_types": LINEAR,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "linear_conv_kernel_dim": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_key_value_heads": 4,
            "num_expert_group": 1,
            "topk_group": 1,
        },
        "sdpa",
    ),
    "zamba": ("zamba", dict(attn_layer_period=2, attn_layer_offset=1), "sdpa"),
}


def config(name: str):
    """The family's tiny config."""
    import transformers

    model_type, over, _ = FAMILIES[name]
    over = {**BASE, **over}
    if over.get("head_dim", 0) is None:
        del over["head_dim"]
    return transformers.AutoConfig.for_model(model_type, **over)


def build(name: str, attn: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The family's tiny causal LM with attention ``attn`` ("tokenring", or the reference's), in ``dtype``."""
    import transformers

    cfg = config(name)
    torch.manual_seed(seed)
    kw = {} if dtype != torch.float64 else {"experts_implementation": "eager"}  # grouped_mm: no float64
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype, **kw)
    with torch.no_grad():  # parameters some families leave uninitialised (sinks) get values that matter
        for n, p in model.named_parameters():
            if not torch.isfinite(p).all() or (n.endswith("sinks") and p.abs().max() == 0):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()).view_as(p))
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# relative, on logits, loss and every gradient; a gradient may also be off by up to 4x the one process's own
# floor (see one_family): float32 inside some families' kernels (norms, routers, the GDN and Mamba scans) puts
# that floor at 1e-7..1e-2 on sums with heavy cancellation (dt_bias, A_log), whatever the dtype of the model
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def _float32_scans(model) -> bool:
    """The model has a mixer state passing runs through a float32 scan (Gated DeltaNet, KDA, Mamba2)."""
    from tokenring import mixers

    return any((mixers.coverage(type(m)) or set()) & {"delta", "ssd"} for m in model.modules())


def _loss(logits: torch.Tensor, targets: torch.Tensor, n) -> torch.Tensor:
    """Summed next-token cross entropy over ``n`` targets, in float64 (transformers' own loss upcasts to float32,
    which would hide a float64 comparison)."""
    flat = logits.double().flatten(0, 1)
    return torch.nn.functional.cross_entropy(flat, targets.flatten(), ignore_index=-100, reduction="sum") / n


def one_family(
    rank: int,
    P: int,
    name: str,
    S: int,
    strategy: str = "auto",
    check: bool = True,
    dtype=torch.float64,
    mixers_mode: str | None = None,
) -> dict:
    """The sharded model vs one process on ``S`` tokens, one training step: ``{"outcome": "exact" | "refused" |
    "differs", ...}`` with the relative errors (rank 0) or the refusal's message. ``check=False`` leaves the
    model's sequence mixers unprepared (bench only: what preparing them prevents; they then see one shard);
    ``mixers_mode``: ``tokenring.hf.prepare(model, mixers=...)`` first."""
    import tokenring.hf as thf
    from tokenring import mixers

    ref_attn = FAMILIES[name][2]
    model = build(name, "tokenring", dtype=dtype)
    ids = torch.randint(3, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    res: dict = {"family": name, "model": type(model).__name__}
    if not check:  # marked as holding no sequence mixer: they run on this rank's shard alone
        mixers._prepared[model] = None
    try:
        if mixers_mode is not None:
            thf.prepare(model, mixers=mixers_mode)
        with thf.settings(strategy=strategy):
            batch = thf.shard_batch(ids, labels=ids)
            out = model(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")})
            loss = _loss(out.logits, batch["shift_labels"], batch["num_items_in_batch"])
            loss.backward()
            thf.all_reduce_grads(model)
            loss = thf.reduce_loss(loss)
            logits = thf.gather_logits(out.logits)
    except ValueError as e:
        return {**res, "outcome": "refused", "error": str(e)}
    res["outcome"] = "ran"  # rank 0 compares with one process and says exact or differs
    if rank == 0:
        ref = build(name, ref_attn, dtype=dtype)
        ref.load_state_dict(model.state_dict())
        r = ref(input_ids=ids, use_cache=False)
        ref_loss = _loss(r.logits[:, :-1], ids[:, 1:], S - 1)
        ref_loss.backward()
        grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        # the same one process, its loss taken as the ranks take it (each rank's rows apart, summed): how far a
        # gradient moves with the order of its sums alone (float32 inside some kernels makes that visible)
        ref.zero_grad()
        r = ref(input_ids=ids, use_cache=False)
        logp = r.logits[:, :-1]
        from tokenring.layouts import local_positions

        for q in range(P):
            rows = local_positions(S, P, q, "zigzag")
            rows = rows[rows < S - 1]
            _loss(logp[:, rows], ids[:, 1:][:, rows], S - 1).backward(retain_graph=q < P - 1)
        res["floor"] = max(rel(p.grad, grads[n]) for n, p in ref.named_parameters() if n in grads)
        split = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        res["grad_vs_split"] = max(rel(p.grad, split[n]) for n, p in model.named_parameters() if n in split)
        res["logits"] = rel(logits, r.logits.detach())
        res["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        res["grad"], res["worst"] = max(
            (rel(p.grad, grads[n]) if n in grads else float("inf"), n)
            for n, p in model.named_parameters()
            if p.grad is not None and (n in grads or p.grad.abs().max() > 0)
        )
        # transformers' eager attention takes its softmax in float32, and a float64 model that keeps float32
        # parameters computes with them in float32 (deepseek_v3's router since transformers 5.25): inputs that
        # agree to 1e-16 can round to neighbouring float32 values, so a float64 reference is good to ~1e-7 there
        # (deepseek_v3 at P=3: logits 8.8e-8, from an expert output 4.3e-8 off on one rank's rows)
        # transformers' torch Gated DeltaNet and Mamba2 scans compute in float32 whatever the model's dtype, and
        # state passing splits their sums at other places than one process does (qwen3_5 at P=2: logits 7.6e-8)
        float32_inside = any(p.dtype == torch.float32 for p in ref.parameters()) or _float32_scans(model)
        tol = 1e-6 if (ref_attn == "eager" or float32_inside) and dtype == torch.float64 else TOL[dtype]
        exact = max(res["logits"], res["loss"]) < tol and res["grad"] <= max(tol, 4 * res["floor"])
        res["outcome"] = "exact" if exact else "differs"
    return res


def sweep(rank: int, P: int, names: list[str], S: int, dtype: str = "float64", mixers: str | None = None) -> list[dict]:
    """:func:`one_family` for each family, in one set of ranks (``mixers``: how to prepare the hybrids)."""
    return [one_family(rank, P, name, S, dtype=getattr(torch, dtype), mixers_mode=mixers) for name in names]


def generate_family(
    rank: int, P: int, name: str, S: int, new_tokens: int, turn: int = 0, sample: bool = False, batch: int = 1
) -> dict:
    """``tokenring.hf.prefill`` of ``S`` tokens + ``generate`` (greedy, or ``sample``d with every rank and the
    reference seeded alike), then (``turn`` > 0) ``tokenring.hf.extend`` by a next turn of ``turn`` tokens +
    ``generate`` again, vs rank 0's single process with transformers' own cache: ``{"outcome": "exact" |
    "refused" | "differs", ...}``."""
    import tokenring.hf as thf

    model = build(name, "tokenring").eval()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (batch, S), generator=gen)
    nxt = torch.randint(3, model.config.vocab_size, (batch, turn), generator=gen)
    kw = dict(max_new_tokens=new_tokens, do_sample=sample, output_logits=True, return_dict_in_generate=True)
    if sample:
        kw.update(top_k=0, top_p=1.0, temperature=1.0)
    torch.manual_seed(5)
    kw.update(pad_token_id=0, eos_token_id=None)
    res: dict = {"family": name}
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=thf.prefill(model, ids), **kw)
            runs = [out]
            if turn:
                conv = torch.cat([out.sequences, nxt], dim=1)
                cache = thf.extend(model, out.past_key_values, conv)
                runs.append(model.generate(conv, attention_mask=torch.ones_like(conv), cache=cache, **kw))
    except ValueError as e:
        return {**res, "outcome": "refused", "error": str(e)}
    res["tokens"] = [r.sequences.tolist() for r in runs]
    res["outcome"] = "ran"
    if rank == 0:
        ref = build(name, FAMILIES[name][2]).eval()
        ref.load_state_dict(model.state_dict())
        torch.manual_seed(5)
        with torch.no_grad():
            want = [ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)]
            if turn:
                conv = torch.cat([want[0].sequences, nxt], dim=1)
                want.append(ref.generate(conv, attention_mask=torch.ones_like(conv), **kw))
        res["want"] = [w.sequences.tolist() for w in want]
        res["logits"] = max(rel(a, b) for got, w in zip(runs, want) for a, b in zip(got.logits, w.logits))
        res["outcome"] = "exact" if res["want"] == res["tokens"] and res["logits"] < 1e-4 else "differs"
    return res


def compiled_refusal(rank: int, P: int, name: str) -> str:
    """``torch.compile(model)`` of a refused family, one sharded forward: the refusal's message on this rank."""
    import tokenring.hf as thf

    torch._dynamo.reset()
    model = torch.compile(build(name, "tokenring"))
    ids = torch.randint(3, 128, (1, 8 * P), generator=torch.Generator().manual_seed(1))
    try:
        model(**thf.shard_batch(ids))
    except Exception as e:  # dynamo may wrap the op's ValueError; its message stays
        return str(e)
    return "not refused"


def unprepared(rank: int, P: int, names: list[str], S: int) -> list[dict]:
    """:func:`one_family` with the sequence mixers left on each rank's shard (what preparing them prevents)."""
    return [one_family(rank, P, name, S, check=False) for name in names]


def compiled_prepared(rank: int, P: int, name: str) -> dict:
    """``tokenring.hf.prepare(model)`` then ``torch.compile(model)`` of a hybrid, one sharded forward: logits vs
    one process (float32)."""
    import tokenring.hf as thf

    torch._dynamo.reset()
    model = build(name, "tokenring")
    ref = build(name, FAMILIES[name][2])
    ref.load_state_dict(model.state_dict())
    thf.prepare(model)
    fast = torch.compile(model)
    ids = torch.randint(3, 128, (1, 8 * P), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = thf.gather_logits(fast(**thf.shard_batch(ids)).logits)
        want = ref(input_ids=ids, use_cache=False).logits
    return {"logits": rel(logits, want)}


def hybrid_batch(
    rank: int, P: int, name: str, layout: str, docs: list[int], batch: int = 1, right_pad: int = 0
) -> dict:
    """One float64 training step of a hybrid sharded in ``layout`` over packed documents of lengths ``docs``
    (``batch`` rows packed alike; ``right_pad``: that many pads at the end of row 1), vs one process running each
    document of each row on its own (what packing means; transformers' torch scans would carry state across
    documents): relative errors of logits (real tokens), loss and every gradient, on rank 0."""
    import tokenring.hf as thf

    model = build(name, "tokenring", dtype=torch.float64)
    S = sum(docs)
    starts = [0, *torch.tensor(docs).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, model.config.vocab_size, (batch, S), generator=gen)
    pos = torch.cat([torch.arange(n) for n in docs]).expand(batch, S)
    labels = ids.clone()
    labels[:, starts[:-1]] = -100  # no target crosses into the next document
    mask = torch.ones(batch, S, dtype=torch.long)
    if right_pad:
        mask[1, S - right_pad :] = 0
        labels[1, S - right_pad - 1 :] = -100
    with thf.settings(layout=layout):
        b = thf.shard_batch(ids, labels=labels, position_ids=pos, attention_mask=mask if right_pad else None)
        out = model(**{k: v for k, v in b.items() if k not in ("labels", "shift_labels")})
        loss = _loss(out.logits, b["shift_labels"], b["num_items_in_batch"])
        loss.backward()
        thf.all_reduce_grads(model)
        loss = thf.reduce_loss(loss)
        logits = thf.gather_logits(out.logits, length=S, cu_seqlens=b.get("cu_seq_lens_q"))
    if rank:
        return {}
    ref = build(name, FAMILIES[name][2], dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    n = (targets != -100).sum()
    want, total = [], 0.0
    for a, e in zip(starts, starts[1:]):
        r = ref(input_ids=ids[:, a:e], attention_mask=mask[:, a:e], use_cache=False).logits
        total = total + _loss(r, targets[:, a:e], n)
        want.append(r.detach())
    total.backward()
    want = torch.cat(want, dim=1)
    real = mask.bool()
    res = {"logits": rel(logits[real], want[real]), "loss": abs(loss.item() - total.item()) / abs(total.item())}
    grads = {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None}
    res["grad"], res["worst"] = max((rel(p.grad, grads[k]), k) for k, p in model.named_parameters() if k in grads)
    # the floor, as one_family takes it: the same one process with its loss summed in halves of the tokens
    ref.zero_grad()
    for half in (0, 1):
        for a, e in zip(starts, starts[1:]):
            r = ref(input_ids=ids[:, a:e], attention_mask=mask[:, a:e], use_cache=False).logits
            t = targets[:, a:e].clone()
            t[:, (torch.arange(a, e) % 2) != half] = -100
            _loss(r, t, n).backward()
    res["floor"] = max(rel(p.grad, grads[k]) for k, p in ref.named_parameters() if k in grads)
    return res
