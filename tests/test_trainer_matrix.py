"""SequenceParallelTrainer against the stock transformers.Trainer in one process, one Trainer feature at a time
(tests/trainer_matrix.py, FEATURES: adding a feature is one line there), at (dp, cp) = (1, 2) and (2, 2): the
logged losses, grad norms and learning rates of 3 steps, the evaluation loss over a remainder batch, predictions
with and without labels, tokens seen, callback events, and the parameter updates, within the feature's relative
tolerance (float32: 1e-4)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_matrix  # noqa: E402

_reference: dict = {}


def _one_process(feature: str, dp: int) -> dict:
    if (feature, dp) not in _reference:
        _reference[(feature, dp)] = trainer_matrix.run(feature, dp)
    return _reference[(feature, dp)]


# every feature at (dp, cp) = (1, 2) and (2, 2); torch.compile (the slowest by far) at (2, 2) only
CELLS = [(f, dp, 2) for f in sorted(trainer_matrix.FEATURES) for dp in (1, 2) if (f, dp) != ("compile", 1)]


@pytest.mark.parametrize("feature,dp,cp", CELLS)
def test_trainer_feature_matches_one_process(pools, feature, dp, cp):
    tol = trainer_matrix.FEATURES[feature].get("tol", 1e-4)
    got = pools(dp * cp).run(trainer_matrix.sequence_parallel, dp, feature)
    want = _one_process(feature, dp)
    for r in got:
        diff = trainer_matrix.differences(
            r, want, padded=dp > 1 and trainer_matrix.FEATURES[feature].get("data") == "pad"
        )
        assert diff["tokens"] == 0 and diff["events"] == 0, (r["tokens"], want["tokens"], r["events"], want["events"])
        assert max(diff.values()) < tol, " ".join(f"{k}={v:.1e}" for k, v in diff.items())


@pytest.mark.parametrize("name", sorted(trainer_matrix.REFUSED))
def test_trainer_refuses_what_it_cannot_match(pools, name):
    """What cannot equal one process raises ValueError on every rank when the trainer is built."""
    words = trainer_matrix.REFUSED[name][1]
    msgs = pools(4).run(trainer_matrix.refused, 2, name)
    assert all(words in m and "SequenceParallelTrainer" in m for m in msgs), msgs
