"""Batched generation from left-padded prompts of different lengths over a sharded KV cache
(``tokenring.hf.prefill(model, ids, attention_mask=mask)`` + ``model.generate(ids, attention_mask=mask,
cache=cache)``): the same ids on every rank as one process with transformers' own attention and cache, logits
within 1e-4 (float32), greedy and sampled; and what it refuses."""

import pytest

pytest.importorskip("transformers")

import generate_cases  # noqa: E402


@pytest.mark.parametrize(
    "P, lengths",
    [
        (2, [37, 64, 5]),  # 64 tokens: all prefilled sharded
        (3, [37, 65, 2]),  # 60 sharded + 5 as one decode step, 3 of row 2's pads among them
    ],
)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_left_padded_batch_matches_single_process(pools, P, lengths, sample):
    """A 2-layer GQA Llama, 3 prompts left-padded to one length, 12 new tokens (sampled: top_k=20, a fixed
    seed): every rank's ids equal one process's, logits within 1e-4."""
    res = pools(P).run(generate_cases.padded_generate, lengths, 12, sample)
    for r in res:
        assert r["tokens"] == res[0]["want"], "generated ids differ from one process"
        assert r["kept"] == 0, "a layer keeps the K/V of before its last step (twice the cache's memory)"
    assert res[0]["logits"] < 1e-4, res[0]["logits"]


def test_left_padded_window_and_sinks(pools):
    """gpt-oss (attention sinks, sliding window 32 on every other layer; the reference runs eager attention): the
    pads combine with the window, greedy ids equal one process's."""
    res = pools(2).run(generate_cases.padded_generate, [50, 21, 64], 8, False, "gpt_oss")
    assert all(r["tokens"] == res[0]["want"] for r in res) and res[0]["logits"] < 1e-4, res[0]


def test_padding_refusals(pools):
    for msgs in pools(3).run(generate_cases.padded_refusals):
        assert "padded on the left only" in msgs["right"] and "row 0" in msgs["hole"], msgs
        assert "different prompt" in msgs["ranks"] and "layout='zigzag'" in msgs["layout"], msgs
        assert "given to tokenring.hf.prefill" in msgs["unpadded_generate"], msgs
        assert "does not pad the rows" in msgs["other_generate"], msgs
        assert msgs["kept"] and msgs["after"], msgs  # the refused step left the cache as it was
        assert "prefilled without one" in msgs["padded_generate"], msgs
        assert "left-padded prompts" in msgs["extend"], msgs
