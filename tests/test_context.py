"""tokenring.context_parallel: plain PyTorch models whose SDPA calls run sequence-parallel, against the same model
in one process (float64: 1e-9 relative): a TorchTitan-style Llama (forward, backward, one optimizer step), a DiT
block, a diffusers Flux transformer step; a compiled block (fullgraph, float32: 1e-5); a mask refused on every
rank."""

import context_cases
import pytest

TOL = 1e-9


@pytest.mark.parametrize("P,S", [(2, 32), (3, 48), (2, 29), (3, 7)])
def test_titan_llama_trains_a_step(pools, P, S):
    """Even lengths, and lengths zigzag splits unevenly (29 over 2 ranks, 7 over 3)."""
    r = pools(P).run(context_cases.llama_step, S)
    assert all(x["restored"] for x in r), r
    assert r[0]["loss"] < TOL and r[0]["grad"] < TOL and r[0]["params"] < TOL, r[0]


@pytest.mark.parametrize("P,S", [(2, 16), (3, 24), (3, 25)])
def test_dit_block(pools, P, S):
    r = pools(P).run(context_cases.dit_step, S)[0]
    assert max(r.values()) < TOL, r


@pytest.mark.parametrize("P,n_img,n_txt", [(2, 16, 8), (3, 24, 12), (2, 61, 7), (3, 64, 8), (4, 30, 5)])
def test_diffusers_flux_step(pools, P, n_img, n_txt):
    """Even splits, and text / image counts each split unevenly, so the ranks' joint rows differ (at P=4, 30 + 5
    gives the last rank 6 rows whether joined or image only: the ranks exchange counts for those calls)."""
    pytest.importorskip("diffusers")
    r = pools(P).run(context_cases.flux_step, n_img, n_txt)[0]
    assert max(r.values()) < TOL, r


@pytest.mark.parametrize("P,family,image", [(2, "deit", 16), (3, "vit", 20), (4, "deit", 12)])
def test_vit_encoder_at_token_counts_not_a_multiple_of_P(pools, P, family, image):
    """18, 26 and 11 tokens (patches of 4 plus class / distillation tokens) over 2, 3 and 4 ranks. The key
    projection's bias has a zero gradient in exact arithmetic (softmax ignores a shift of every key): both runs
    give rounding there, so gradients are compared on the scale of the largest."""
    r = pools(P).run(context_cases.vit_step, family, image, 4)[0]
    assert r["out"] < TOL and r["grad"] < TOL and r["key_bias"] < TOL, r


def test_compiled_without_graph_breaks(pools):
    r = pools(2).run(context_cases.compiled_dit, 16)[0]
    assert max(r.values()) < 1e-5, r


def test_mask_is_refused_on_every_rank(pools):
    msgs = pools(3).run(context_cases.refused_mask)
    assert all("attn_mask" in m and "is_causal" in m for m in msgs), msgs


@pytest.mark.parametrize("P", [2, 3])
def test_packed_documents_under_auto_layout(pools, P):
    """context_parallel(layout="auto", cu_seqlens=...): the buffer is cut with the placement the chooser picks
    for these documents (each forced once, and the cost model's own), the SDPA calls run under it, and gather
    with layout="auto" puts the output back: as one process with the documents' block-causal mask."""
    S = 24 * P
    for i, pick in enumerate(("whole_docs", "balanced", "contiguous", None)):
        cu = [0, 3 + i, 11, S - 5, S]
        for r in pools(P).run(context_cases.packed_auto_step, S, cu, pick):
            assert r["out"] < TOL and r["grad"] < TOL and r["held"], (pick, r)
            assert r["placed"] == (pick or r["placed"]), (pick, r)
