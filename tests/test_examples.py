"""The examples in examples/, at small sizes, on P=4 gloo ranks: each checks itself against one process."""
import pytest

from example_cases import run_example


@pytest.mark.parametrize("strategy", ["token_ring", "ring", "ulysses"])
def test_dit_block_non_causal(pools, strategy):
    r = pools(4).run(run_example, "dit_block", "run", 512, 128, strategy)[0]
    assert max(r["attn"], r["out"], r["dx"], r["grad"]) < 1e-4, r


def test_finetune_step(pools):
    pytest.importorskip("transformers")
    r = pools(4).run(run_example, "finetune_long_context", "train", 1024, 2, "auto")[0]
    assert r["grad_rel"] < 1e-4, r
    assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < 1e-5, r
    assert r["param_diff"] < 1e-3, r
