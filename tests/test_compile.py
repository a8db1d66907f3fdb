"""torch.compile: ``tokenring.attention`` is one custom op per layer, so a model compiles whole
(``fullgraph=True``: any graph break raises) and trains as in eager mode; the per-layer input checks run once
per forward. The AOT-eager backend traces what inductor would (fake implementations, the autograd formula)
without spending minutes in the C++ compiler."""

import pytest

pytest.importorskip("transformers")

import compile_cases  # noqa: E402


@pytest.mark.parametrize(
    "strategy", ["token_ring", "ulysses", "auto", "usp:n=2", "double_ring:n=2", "token_ring_2d:n=2"]
)
def test_fullgraph_matches_eager(pools, strategy):
    P = 4 if strategy.endswith(":n=2") else 2
    res = pools(P).run(compile_cases.compiled_matches_eager, 64, strategy)
    for r in res:
        assert r["frames"] == 1 and r["breaks"] == 0, r
        for i in range(2):
            assert r[f"loss{i}"] < 1e-6 and r[f"grad{i}"] < 1e-6, r


def test_fullgraph_packed_documents(pools):
    """Packed documents: their bounds are values, read inside the op at run time (not a guard)."""
    res = pools(2).run(compile_cases.compiled_matches_eager, 64, "ring", [10, 33, 21])
    for r in res:
        assert r["frames"] == 1 and r["breaks"] == 0 and r["grad0"] < 1e-6 and r["grad1"] < 1e-6, r


@pytest.mark.parametrize("layout", ["balanced", "zigzag_docs", "whole_docs"])
def test_fullgraph_document_layouts(pools, layout):
    """The layouts that place tokens by document: traced without the documents (values), run with them."""
    res = pools(2).run(compile_cases.compiled_matches_eager, 48, "auto", [16, 8, 24], "llama", None, layout)
    for r in res:
        assert r["frames"] == 1 and r["breaks"] == 0 and r["grad0"] < 1e-6 and r["grad1"] < 1e-6, r


@pytest.mark.parametrize(
    "family,P,layout,docs,B",
    [
        ("qwen3_5", 2, "zigzag", [10, 14], 2),
        ("bamba", 3, "balanced", [7, 20, 9], 1),
        ("lfm2", 2, "contiguous", None, 1),
    ],
)
def test_fullgraph_hybrid_mixers(pools, family, P, layout, docs, B):
    """Hybrids (Gated DeltaNet, Mamba2, short convolutions) compile whole: each mixer's sharded kernel call is
    one op (``tokenring::mixer_kernel``) whose backward recomputes it; float64, the same as eager to 1e-12. Its
    outputs keep the strides its fake declares (B = 2: the compiled backward views them)."""
    S = sum(docs) if docs else 12 * P
    res = pools(P).run(compile_cases.compiled_matches_eager, S, "auto", docs, "llama", None, layout, family, B)
    for r in res:
        assert r["frames"] == 1 and r["breaks"] == 0 and r["same_grads"], r
        assert max(r["loss0"], r["loss1"], r["grad0"], r["grad1"]) < 1e-12, r


def test_fullgraph_sinks_model(pools):
    """gpt-oss (attention sinks, sliding layers, experts) compiles whole too."""
    res = pools(2).run(compile_cases.compiled_matches_eager, 64, "token_ring", None, "gpt_oss", {})
    for r in res:
        assert r["frames"] == 1 and r["breaks"] == 0 and r["grad0"] < 1e-6 and r["grad1"] < 1e-6, r


def test_checks_once_per_forward(pools):
    """A 3-layer model: its position ids are gathered and read once per forward (not per layer), with one
    exchange of the ranks' flags; attention signatures are exchanged on the first call only."""
    res = pools(2).run(compile_cases.checks_once_per_forward, 32, 3)
    for r in res:
        assert r[0][0] == 1 and r[1][0] == 1 and r[2][0] == 1, r
        assert r[0][1] > 1 and r[1][1] == 1 and r[2][1] == 1, r


PACKED = (72, [10, 40, 22])  # a packed batch: its documents are values, read in the op


def test_fullgraph_over_changing_lengths(pools):
    """Lengths that change between steps: one graph for them all under dynamic=True, the static first one and one
    dynamic graph under dynamic=None; the length's checks run in the op, not as guards. A packed batch passes
    documents (other inputs): one graph more, for every length."""
    batches = [(64, None), (96, None), (52, None), PACKED]
    for dynamic, graphs in ((None, 3), (True, 2)):
        for r in pools(2).run(compile_cases.over_lengths, batches, "token_ring", dynamic):
            assert r["graphs"] <= graphs and r["frames"] <= 3 and r["breaks"] == 0, (dynamic, r)
            assert r["loss"] < 1e-6 and r["grad"] < 1e-6, (dynamic, r)


@pytest.mark.parametrize("P, strategy, dynamic", [(1, "token_ring", True), (2, "ulysses", True), (3, "auto", None)])
def test_changing_lengths_per_strategy(pools, P, strategy, dynamic):
    """The same over other strategies and group sizes (``auto`` chooses by the first dynamic length's hint): two
    lengths and a packed batch."""
    batches = [(S * P, None) for S in (32, 26)] + [(12 * P, [6 * P, 6 * P])]
    for r in pools(P).run(compile_cases.over_lengths, batches, strategy, dynamic):
        assert r["graphs"] <= (3 if dynamic is None else 2) and r["frames"] <= 3 and r["breaks"] == 0, r
        assert r["loss"] < 1e-6 and r["grad"] < 1e-6, r


def test_compiled_refusals_are_value_errors(pools):
    """A compiled call refused (a length in the op at run time, heads by the plan at trace time) raises eager's
    ValueError, on every rank."""
    for r in pools(2).run(compile_cases.refused_when_compiled):
        assert r["odd length good"] == "ran", r
        for name in ("odd length", "heads"):
            assert r[f"{name} eager"].startswith("ValueError: rank "), r
            assert r[f"{name} compiled"] == r[f"{name} eager"], r


def test_decode_step_compiles_whole(pools):
    """decode_attention without its step check is one custom-op node: a decode step compiles with fullgraph=True
    (one graph, no break) and equals eager (float32: 1e-6); with the check it runs through a graph break."""
    for r in pools(2).run(compile_cases.decode_step_compiled):
        assert r["graphs"] == 1 and r["breaks"] == 0 and r["diff"] < 1e-6 and r["checked"] < 1e-6, r
