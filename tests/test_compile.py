"""torch.compile: ``tokenring.attention`` is one custom op per layer, so a model compiles whole
(``fullgraph=True``: any graph break raises) and trains as in eager mode; the per-layer input checks run once
per forward. The AOT-eager backend traces what inductor would (fake implementations, the autograd formula)
without spending minutes in the C++ compiler."""

import pytest

pytest.importorskip("transformers")

import compile_cases  # noqa: E402


@pytest.mark.parametrize(
    "strategy", ["token_ring", "ulysses", "auto", "ring_bidir", "usp:n=2", "double_ring:n=2", "token_ring_2d:n=2"]
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
