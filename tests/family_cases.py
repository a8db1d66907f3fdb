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
    "nemotron_h": ("nemotron_h", {**MAMBA, "layers_block_type": ["mamba", "attention", "mlp", "attention"]}, "sdpa"),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention", "conv", "full_attention"]), "sdpa"),
    "minimax": ("minimax", {**MOE, "layer_types": LINEAR}, "sdpa"),
    "zamba": ("zamba", dict(attn_layer_period=2, attn_layer_offset=1), "sdpa"),
}


def build(name: str, attn: str, seed: int = 0):
    """The family's tiny causal LM with attention ``attn`` ("tokenring", or the reference's), float32."""
    import transformers

    model_type, over, _ = FAMILIES[name]
    over = {**BASE, **over}
    if over.get("head_dim", 0) is None:
        del over["head_dim"]
    cfg = transformers.AutoConfig.for_model(model_type, **over)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # parameters some families leave uninitialised (sinks) get values that matter
        for n, p in model.named_parameters():
            if not torch.isfinite(p).all() or (n.endswith("sinks") and p.abs().max() == 0):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()).view_as(p))
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def one_family(rank: int, P: int, name: str, S: int, strategy: str = "auto", check: bool = True) -> dict:
    """The sharded model vs one process on ``S`` tokens: ``{"outcome": "exact" | "refused" | "differs", ...}``
    with the errors (rank 0) or the refusal's message. ``check=False`` switches the mixer refusal off, to
    measure what it prevents (bench only)."""
    import tokenring.hf as thf
    from tokenring import mixers

    ref_attn = FAMILIES[name][2]
    model = build(name, "tokenring")
    ids = torch.randint(3, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    res: dict = {"family": name, "model": type(model).__name__}
    saved = mixers.check_model
    if not check:
        mixers.check_model = lambda *a, **k: None
    try:
        with thf.settings(strategy=strategy):
            batch = thf.shard_batch(ids, labels=ids)
            out = model(**batch)
            out.loss.backward()
            thf.all_reduce_grads(model)
            loss = thf.reduce_loss(out.loss)
            logits = thf.gather_logits(out.logits)
    except ValueError as e:
        return {**res, "outcome": "refused", "error": str(e)}
    finally:
        mixers.check_model = saved
    res["outcome"] = "ran"  # rank 0 compares with one process and says exact or differs
    if rank == 0:
        ref = build(name, ref_attn)
        ref.load_state_dict(model.state_dict())
        r = ref(input_ids=ids, labels=ids, use_cache=False)
        r.loss.backward()
        grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        res["logits"] = rel(logits, r.logits.detach())
        res["loss"] = abs(loss.item() - r.loss.item())
        res["grad"], res["worst"] = max(
            (rel(p.grad, grads[n]) if n in grads else float("inf"), n)
            for n, p in model.named_parameters()
            if p.grad is not None and (n in grads or p.grad.abs().max() > 0)
        )
        exact = res["logits"] < 1e-4 and res["loss"] < 1e-5 and res["grad"] < 1e-3
        res["outcome"] = "exact" if exact else "differs"
    return res


def sweep(rank: int, P: int, names: list[str], S: int) -> list[dict]:
    """:func:`one_family` for each family, in one set of ranks."""
    return [one_family(rank, P, name, S) for name in names]
