"""Refusals leave nothing behind: after each ValueError of ``tokenring.hf.shard_batch`` and
``SequenceParallel.shard_batch``, ``tokenring.hf.configure`` / ``settings`` / ``tokenring.configure``,
``prefill``, ``extend``, ``model.generate`` over a ShardedCache and ``SequenceParallelTrainer`` (at
construction and at a refused step), raised on every rank with a message naming the problem, the settings, the
model and the caches made before it are as they were, and the normal calls that follow (a forward+backward
through shard_batch, prefill + 4 greedy tokens, extend + 4 tokens, 4 tokens over a left-padded prefill) equal
bit for bit the same calls before any refusal (tests/refusal_cases.py). The attention layers' own refusals:
tests/test_comm_and_errors.py and tests/test_hf.py."""

import pytest

pytest.importorskip("transformers")

import refusal_cases  # noqa: E402

KINDS = {
    "shard_batch_samples", "shard_batch_hole", "shard_batch_pad_target", "shard_batch_packing",
    "shard_batch_mask_shape", "configure", "settings_block", "core_configure", "sequence_parallel_layout",
    "prefill_prompts", "prefill_right_padding", "prefill_hole", "extend_ranks", "extend_other_model",
    "extend_edited", "extend_padded", "generate_beam", "generate_other_model", "generate_mask",
    "generate_unpadded_mask", "generate_padded_mask", "sp_samples", "sp_hole", "sp_pad_target", "sp_packing",
    "plain_shard_batch_under_sp", "trainer_compute_loss_func", "trainer_token_average", "trainer_bare_step",
}  # fmt: skip


@pytest.mark.parametrize("P", [2, 3])
def test_refusals_leave_nothing_behind(pools, P):
    every = pools(P).run(refusal_cases.refusals_leave_nothing)
    for res in every:
        assert not res["problems"], "\n".join(res["problems"])
        assert set(res["msgs"]) == KINDS | ({"extend_ulysses"} if P == 3 else set()), sorted(res["msgs"])
