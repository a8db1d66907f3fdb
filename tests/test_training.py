"""Training the way people train, on gloo ranks with a small Llama: transformers.Trainer, accelerate, FSDP2 and
DDP over a (dp, cp) mesh give the first step's gradients and the logged loss of one process on the same global
batch (1e-4 relative; float32); each misuse that used to train silently wrong raises ValueError on every rank."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import train_cases  # noqa: E402

TOL = 1e-4


def test_trainer_evaluates_before_training(pools):
    """SequenceParallelTrainer evaluated before train() (which must still wrap the model in DDP), then one step
    with gradient accumulation at dp=2 x cp=2: the gradients before the optimizer step and the evaluation loss
    of one process. Every other Trainer feature: tests/test_trainer_matrix.py."""
    r = pools(4).run(train_cases.trainer_step, 2, 64, 2, 2, None)[0]
    assert r["loss"] < TOL and r["grad"] < TOL and r["eval"] < TOL, r


@pytest.mark.parametrize(
    "family,P,dp", [("qwen3_next", 2, 1), ("bamba", 3, 1), ("lfm2", 4, 1), ("olmo_hybrid", 4, 1), ("qwen3_next", 4, 2)]
)
def test_trainer_step_of_a_hybrid(pools, family, P, dp):
    """Gated DeltaNet, Mamba2 and short-convolution layers beside attention, by state passing (float64 weights;
    the Trainer's loss is float32): one SequenceParallelTrainer step at dp x cp = P equals one process."""
    r = pools(P).run(train_cases.trainer_step, dp, 24 * P // dp, 2, 1, None, family)[0]
    assert r["loss"] < TOL and r["grad"] < TOL and r["eval"] < TOL, r


def test_fsdp2_step_of_a_hybrid(pools):
    """FSDP2 over the flattened 2 x 2 mesh with a Gated DeltaNet hybrid (Qwen3-Next) sharded by state passing."""
    r = pools(4).run(train_cases.fsdp_step, 2, 48, 2, True, None, "qwen3_next")[0]
    assert r["loss"] < TOL and r["grad"] < TOL, r


@pytest.mark.parametrize("dp", [1, 2])
def test_accelerate_loop(pools, dp):
    r = pools(4).run(train_cases.accelerate_step, dp, 64, 2)[0]
    assert r["loss"] < TOL and r["grad"] < TOL, r


@pytest.mark.parametrize(
    "flat,tiled,head",
    [(True, None, "root"), (False, None, "root"), (True, 16, "root"), (False, 16, "root"), (True, 16, "own")]
    + [(False, 16, "tied")],
)
def test_fsdp2(pools, flat, tiled, head):
    """FSDP2 over the flattened dp x cp mesh (loss scaled), or over dp with all_reduce_grads over cp (DTensor
    gradients); with the loss tiled (the head's sharded weight used chunk by chunk) or not; ``lm_head`` in the
    root unit, in a unit of its own (the tiled loss must call it through its hooks), or tied to the embedding."""
    r = pools(4).run(train_cases.fsdp_step, 2, 64, 2, flat, tiled, None, head)[0]
    assert r["loss"] < TOL and r["grad"] < TOL, r


def test_misuse_is_refused_on_every_rank(pools):
    plain = pools(4).run(train_cases.accelerate_step, 2, 64, 2, True)
    assert all("DDP averages" in m and "1/2" in m for m in plain), plain
    stock = pools(2).run(train_cases.stock_trainer_refused, 64)
    assert all("SequenceParallel" in m for m in stock), stock
    for m in pools(4).run(train_cases.misuse_refused, 64):
        assert "dp times the true gradient" in m["world"], m
        assert "already reduces" in m["ddp"], m
        assert "data loader" in m["samples"], m
        assert "its shard_batch" in m["plain"], m


def test_trainer_in_one_process():
    """The same script on one process (no process group) trains as plain transformers would."""
    assert train_cases.single_process_trainer()["loss"] < TOL


def test_every_wiring_trains_exactly_or_is_refused(pools):
    """DDP over dp only with SequenceParallel trains exactly (its average is widened to every rank); FSDP over dp
    only with SequenceParallel, FSDP over every rank with plain shard_batch, and DDP over dp with plain
    shard_batch are refused on every rank before the first backward."""
    r = pools(4).run(train_cases.wiring_step, 2, "ddp_dp")[0]
    assert r["loss"] < TOL and r["grad"] < TOL, r
    for how, words in (
        ("fsdp_dp", "sp.flat_mesh"),
        ("fsdp_world_plain", "1/2 of the true one"),
        ("ddp_dp_plain", "never be summed"),
    ):
        msgs = pools(4).run(train_cases.wiring_step, 2, how)
        assert all(isinstance(m, str) and words in m for m in msgs), (how, msgs)


def test_a_closed_mesh_leaves_the_layers_group_as_it_was(pools):
    """SequenceParallel sets the hf layers' group to its cp ranks; close() puts the earlier group back, so a later
    model over every rank attends over every rank (before: over the closed mesh's cp pairs, wrong logits and
    ranks sampling apart)."""
    for err in pools(4).run(train_cases.after_closed_mesh):
        assert err < 1e-5, err
