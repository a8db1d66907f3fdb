"""Hugging Face integration: a Llama-architecture model (GQA) with attn_implementation="tokenring" on P=4 gloo
ranks equals the single-process model (transformers' own sdpa attention, same weights): logits within 1e-4
(float32) and one training step's loss and parameter gradients within 1e-4 relative, for every strategy.
Skipped when transformers is not installed (it is an optional extra)."""

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import hf_cases  # noqa: E402

STRATEGIES = ["token_ring", "ring", "ring_bidir", "ulysses"]


def test_llama_gqa_matches_single_process(pools):
    """The acceptance test: 4 layers, hidden 256, 8 heads, 2 KV heads, S=2048, P=4, each strategy."""
    res = pools(4).run(hf_cases.model_matches, 2048, STRATEGIES)[0]
    for st in STRATEGIES:
        e = res[st]
        assert e["logits"] < 1e-4, f"{st}: max |logits - single-process| = {e['logits']:.3g}"
        assert e["loss"] < 1e-5, f"{st}: |loss - single-process| = {e['loss']:.3g}"
        assert e["grad"] < 1e-4, f"{st}: gradient of {e['worst']} off by {e['grad']:.3g} (relative)"


@pytest.mark.parametrize(
    "arch,over",
    [
        ("qwen2", dict(attention_bias=True)),
        ("qwen3", dict(head_dim=32)),
        ("mistral", dict(sliding_window=None)),
        ("llama", dict(num_key_value_heads=8)),
        ("gpt_oss", {}),
    ],
)
def test_other_families(pools, arch, over):
    res = pools(4).run(hf_cases.model_matches, 256, ["auto"], arch, {**over, "num_hidden_layers": 2})[0]
    assert res["auto"]["logits"] < 1e-4 and res["auto"]["grad"] < 1e-4, res


def test_hierarchical_strategies_in_a_model(pools):
    """The hierarchical strategies over 2 nodes x 2 ranks inside a model: logits and a training step."""
    names = ["usp:n=2", "double_ring:n=2", "token_ring_2d:relay,n=2"]
    res = pools(4).run(hf_cases.model_matches, 256, names, "llama", {"num_hidden_layers": 2})[0]
    for st in names:
        assert res[st]["logits"] < 1e-4 and res[st]["grad"] < 1e-4, (st, res[st])


def test_mistral_sliding_window_matches_single_process(pools):
    """Sliding-window layers (window 96 < S = 512, smaller than a rank's 128 tokens and crossing ranks): logits
    and one training step's loss and gradients equal transformers' own sdpa run, P = 3 and 4."""
    for P in (3, 4):
        S = 128 * P
        res = pools(P).run(
            hf_cases.model_matches, S, ["token_ring", "ring"], "mistral", {"sliding_window": 96, "num_hidden_layers": 2}
        )[0]
        for st in ("token_ring", "ring"):
            e = res[st]
            assert e["logits"] < 1e-4 and e["loss"] < 1e-5 and e["grad"] < 1e-4, (P, st, e)


def test_packed_llama_matches_single_process(pools):
    """A packed batch (position ids restarting per document, as DataCollatorWithFlattening makes it): documents
    shorter than a shard and one spanning ranks; one fine-tuning step equals transformers' own packed sdpa run."""
    S = 1024
    docs = [37, 400, 5, 211, 300, 71]
    assert sum(docs) == S
    res = pools(4).run(hf_cases.model_matches, S, ["token_ring", "ring", "ulysses"], "llama", None, True, docs)[0]
    for st in ("token_ring", "ring", "ulysses"):
        e = res[st]
        assert e["logits"] < 1e-4 and e["loss"] < 1e-5 and e["grad"] < 1e-4, (st, e)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_generate_over_sharded_cache_matches_single_process(pools, P):
    """tokenring.hf.prefill of a 4096-token prompt (P=3: 4092 sharded + 4 as one decode step), then 64 greedy
    tokens with model.generate over the sharded cache (4-layer GQA Llama, float32): the same ids as one process
    with transformers' own cache, logits within 1e-4, every rank holding its share of the cache and together
    exactly the single process's bytes."""
    res = pools(P).run(hf_cases.generate_matches, 4096, 64)
    r0 = res[0]
    for r in res:
        assert r["tokens"] == r0["want"], "generated ids differ from one process"
    assert r0["logits"] < 1e-4, r0["logits"]
    assert sum(r["cache_bytes"] for r in res) == r0["single_cache_bytes"]
    rows = [n for r in res for n in r["held"]]
    assert max(rows) - min(rows) <= 1 and max(rows) <= -(-(4096 + 63) // P)  # balanced: 1/P of the rows each


def test_generate_qwen2_sampling_and_batches(pools):
    """Qwen2 (qkv bias), sampling with a fixed seed, a prompt that does not split evenly (1001 tokens), and a
    batch of 2 greedy prompts: the same ids as one process."""
    res = pools(2).run(hf_cases.generate_matches, 1001, 16, "qwen2", {"attention_bias": True}, True)
    assert all(r["tokens"] == res[0]["want"] for r in res) and res[0]["logits"] < 1e-4, res[0]
    res = pools(3).run(hf_cases.generate_matches, 600, 12, "llama", None, False, 2)
    assert all(r["tokens"] == res[0]["want"] for r in res) and res[0]["logits"] < 1e-4, res[0]


def test_generate_refusals(pools):
    """Different prompts, a cache from another model, a rank generating other tokens than the rest, and a cache
    holding a token more: a ValueError on every rank naming the odd rank out, and the next generate equals the one
    before."""
    for msgs in pools(3).run(hf_cases.generate_refusals):
        # rank 0 is the odd one out (ranks 1 and 2 agree): named, not the two that agree
        assert "different prompts: rank(s) [0] differ" in msgs["prompt"], msgs
        assert "another model" in msgs["model"] or "decodes with a different" in msgs["model"], msgs
        # rank 1 alone samples other tokens (a logits processor of its own): named at the next step, every rank
        assert "feed different tokens at this step: rank(s) [1] differ" in msgs.get("tokens", ""), msgs
        assert "caches are not in step: rank(s) [2] differ" in msgs.get("step", ""), msgs
        assert msgs["same_after"], msgs


def test_plain_path(pools):
    """tokenring.shard ids and positions, call the model, tokenring.gather the logits."""
    assert pools(4).run(hf_cases.plain_path, 512, "token_ring")[0] < 1e-4


def test_refusals(pools):
    every = pools(4).run(hf_cases.refusals, 64)
    msgs = every[0]
    assert "a hole" in msgs["padding"] or "refused its attention mask" in msgs["padding"]
    assert "a hole" in msgs["padding_full"]
    assert "pad position 0 of row 0 has a target" in msgs["pad_target"]
    assert "position_ids" in msgs["positions"] and "tokenring.shard" in msgs["positions"]
    assert "use_cache=False" in msgs["cache"]
    assert "share one packing" in msgs["packing"] and "share one packing" in msgs["packing_batch"]
    assert "dropout" in msgs["dropout"]
    for m in every:  # each rank names what differs
        assert "different local lengths" in m["lengths"] and "{0: 32, 1: 16, 2: 16, 3: 16}" in m["lengths"], m
        assert "different samples" in m["samples"] and "data loader" in m["samples"], m


def test_from_pretrained_single_process(tmp_path):
    """from_pretrained(path, attn_implementation="tokenring") from a local checkpoint; one process: plain attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = hf_cases.build("llama", "sdpa", num_hidden_layers=1)
    model.save_pretrained(tmp_path)
    import tokenring.hf  # noqa: F401  registers the implementation

    tr = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="tokenring")
    assert tr.config._attn_implementation == "tokenring"
    ids = hf_cases.tokens(64, model.config.vocab_size)
    with torch.no_grad():
        assert (tr(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() < 1e-5


def test_core_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch, tokenring\n"
        "q = torch.randn(1, 8, 2, 4)\n"
        "assert tokenring.attention(q, q, q, causal=True).shape == q.shape\n"
        "try:\n    import tokenring.hf\nexcept ImportError as e:\n    assert 'tokenring-attn[hf]' in str(e)\n"
        "else:\n    raise SystemExit('tokenring.hf imported without transformers')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_generate(capsys):
    """`tokenring demo --generate`: prefill + generation on 2 ranks; exit code 0 means the ids equal one process's."""
    from tokenring.tools.demo import main

    assert (
        main(
            [
                "--generate",
                "4",
                "--seq",
                "64",
                "--ranks",
                "2",
                "--hidden",
                "64",
                "--layers",
                "1",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--vocab",
                "128",
                "--quiet",
            ]
        )
        == 0
    )
    assert "KV cache/rank" in capsys.readouterr().out


def test_demo_lists_only_strategies_that_run(capsys):
    """`tokenring demo` (a small model on 2 ranks): no line about strategies that cannot run here (the
    hierarchical ones without a node size), logits equal one process's, and the last line says where each
    strategy wins, naming the results file."""
    from tokenring.tools.demo import main

    argv = "--seq 64 --ranks 2 --hidden 64 --layers 1 --heads 4 --kv-heads 2 --vocab 128 --png= --quiet"
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out and "cannot run" not in out, out
    assert "token_ring " in out and "ulysses " in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("where each wins") and "bench/results/token_ring_wins.md" in last, last


def test_tiled_loss_in_a_model(pools):
    """causal_lm_loss (lm_head + loss over 13-token chunks, never the whole logits) equals the model's own loss
    and gradients, P = 2."""
    for r in pools(2).run(hf_cases.tiled_loss_matches, 64, 13):
        assert r["loss"] < 1e-6 and r["grad"] < 1e-5, r


def test_autocast_bf16(pools):
    """A float32 model under torch.autocast(bfloat16): attention runs in bfloat16 (as sdpa does there) and the
    loss and logits stay within bfloat16 tolerance (2e-2) of one process under the same autocast, P = 2."""
    res = pools(2).run(hf_cases.autocast_matches, 128, "token_ring")
    assert all(r["dtypes"] == ["torch.bfloat16"] for r in res), res
    assert res[0]["loss"] < 2e-2 and res[0]["logits"] < 2e-2, res[0]


@pytest.mark.parametrize("P", [1, 2])
def test_refused_generate_leaves_nothing_behind(pools, P):
    """A refusal after a cache layer stored its rows leaves no step behind for the next call's attention."""
    assert max(pools(P).run(hf_cases.refused_generate_leaves_nothing)) < 1e-4


@pytest.mark.parametrize("P", [2, 3])
def test_sampling_agrees_whatever_each_rank_seeded(pools, P):
    """Sampling (top-k 20) with every rank seeded differently: every rank emits rank 0's tokens, and they equal
    one process seeded as rank 0 (each decode step shares rank 0's random state before the token is drawn)."""
    res = pools(P).run(hf_cases.generate_matches, 96 * P + 1, 24, "llama", {"num_hidden_layers": 2}, True, 1, True)
    assert all(r["tokens"] == res[0]["want"] for r in res), [r["tokens"] for r in res] + [res[0]["want"]]


@pytest.mark.parametrize("mode,tol", [("contiguous", 1e-5), ("autocast", 3e-2)])
def test_generate_contiguous_prefill_and_autocast(pools, mode, tol):
    """prefill(layout="contiguous") and generation under bf16 autocast: one process's tokens; logits within
    float32 (1e-5) and bf16 (3e-2, relative to the largest logit) tolerances."""
    res = pools(2).run(hf_cases.generate_modes, mode)
    assert all(r["tokens"] == res[0]["want"] for r in res) and res[0]["logits"] < tol, res[0]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_any_length_and_padding(pools, P):
    """Lengths that do not split over 2P (packed documents of 1, 3 and 7 tokens among others; one row) and
    right- and left-padded batches of rows of different lengths (each row's real tokens and pads become documents
    of their own): logits over real tokens, the loss and every gradient equal one process (float32: 1e-4
    relative for gradients)."""
    cases = (([1, 3, 7, 120, 2, 50], 1, None), ([61], 1, None), ([37, 64, 5], 3, "right"), ([37, 64, 5, 1], 4, "left"))
    for lengths, rows, pad in cases:
        r = pools(P).run(hf_cases.any_length_matches, lengths, rows, pad)[0]
        assert r["logits"] < 1e-4 and r["loss"] < 1e-5 and r["grad"] < 1e-4, (P, lengths, r)
    for lengths, layout in (
        ([1, 3, 7, 120, 2, 50], "balanced"),
        ([300, 5, 90, 1, 44], "balanced"),
        ([2, 90, 7, 1, 130, 33], "whole_docs"),
        ([16] * P, "contiguous"),
    ):
        # the planner's layout; documents that are each one rank's whole shard (positions 0..s-1 on every rank)
        r = pools(P).run(hf_cases.any_length_matches, lengths, 1, None, layout)[0]
        assert r["logits"] < 1e-4 and r["loss"] < 1e-5 and r["grad"] < 1e-4, (P, lengths, r)


@pytest.mark.parametrize("P", [2, 3])
def test_auto_layout_through_shard_batch(pools, P):
    """layout="auto": shard_batch places each packed batch as the chooser says, and the layers and gather_logits
    resolve the same placement from the cu_seq_lens_q it passes (each placement forced once, on its own
    lengths; the cost model's own pick; a padded batch: its documents are the length padding's, if any). As one
    process."""
    for lengths, pad, pick in (
        ([3, 40, 7, 1, 61, 20], None, "whole_docs"),
        ([30, 5, 90, 1, 44], None, "balanced"),
        ([9, 70, 2, 33, 17], None, "contiguous"),
        ([12, 1, 50, 66, 3], None, "zigzag"),
        ([25, 3, 81, 14], None, None),
        ([37, 64, 5], "right", None),
    ):
        r = pools(P).run(hf_cases.any_length_matches, lengths, 3 if pad else 1, pad, "auto", pick)[0]
        assert r["logits"] < 1e-4 and r["loss"] < 1e-5 and r["grad"] < 1e-4, (P, lengths, pick, r)
        assert r["held_as_placed"] and r["placed"] == (pick or r["placed"]), (P, lengths, pick, r)


def test_tiled_loss_puts_back_an_instance_forward(pools):
    assert all(pools(2).run(hf_cases.tiled_loss_keeps_head_hooks))


def test_large_token_ids_in_the_batch_check(pools):
    """Token ids near 2**63 neither overflow the batch checksum nor let a one-id difference through."""
    for r in pools(2).run(hf_cases.large_ids):
        assert r["shape"] == (2, 8) and r["error"] is not None and "different samples" in r["error"], r


@pytest.mark.parametrize("P", [2, 3])
def test_beam_search_is_refused_and_the_cache_still_generates(pools, P):
    for got in pools(P).run(hf_cases.widened_batch_refused):
        assert all("beam search and num_return_sequences" in m for m in got["msgs"]), got["msgs"]
        assert got["same"]


@pytest.mark.parametrize("P", [2, 3])
def test_bidirectional_padding_is_unpacked(pools, P):
    """A bidirectional encoder over rows padded on the left, the right and both sides: each row's real tokens
    and pads become documents, so real tokens see only their row's real tokens, as sdpa's padding mask says
    (float64: 1e-10)."""
    r = pools(P).run(hf_cases.bidirectional_padding)[0]
    assert r["out"] < 1e-10 and r["grad"] < 1e-10, r


def test_trainer_places_auto_batches_for_the_models_layer():
    """Under layout="auto" SequenceParallelTrainer tells the chooser the model's attention layer (heads, key/value
    heads, head dim from its config), unless the layer setting was given; tokenring.configure(layer=None) undoes."""
    import tokenring
    from tokenring import settings
    from tokenring.hf.trainer import place_for

    model = hf_cases.build("llama", "sdpa", num_hidden_layers=1)
    c = model.config
    try:
        place_for(model)
        assert settings.get("layer") == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        tokenring.configure(layer=(4, 2, 16))
        place_for(model)  # a layer given by the user stays
        assert settings.get("layer") == (4, 2, 16)
    finally:
        tokenring.configure(layer=None)
    assert settings.get("layer") is None
