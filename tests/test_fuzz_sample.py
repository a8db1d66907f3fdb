"""100-call samples of the public-API fuzz (bench/fuzz.py keeps the long runs): of ``tokenring.attention``
(tests/fuzz_cases.py: random valid calls equal float64 attention) and of tokenring.hf's ``shard_batch`` into the HF
layers, ``prefill``, ``extend`` and ``generate`` (tests/fuzz_hf_cases.py: random valid calls equal the same float64
model in one process). Random invalid calls raise a ValueError on every rank and leave the group usable."""

import fuzz_cases
import pytest

SPLIT = [(2, 34), (3, 33), (4, 33)]


@pytest.mark.parametrize("P,n", SPLIT)
def test_fuzz_sample(pools, P, n):
    calls = fuzz_cases.draw_calls(seed=101, P=P, n=n)
    every = pools(P).run(fuzz_cases.run_calls, calls)
    assert all(len(r) == n for r in every)
    for per_rank in zip(*every):
        if per_rank[0]["kind"] != "valid":
            assert all(r["message"] for r in per_rank), per_rank
        else:
            assert all(r["ok"] for r in per_rank), [r.get("failed") for r in per_rank]


@pytest.mark.parametrize("P,n", SPLIT)
def test_fuzz_hf_sample(pools, P, n):
    pytest.importorskip("transformers")
    import fuzz_hf_cases

    calls = fuzz_hf_cases.draw_calls(seed=101, P=P, n=n)
    every = pools(P).run(fuzz_hf_cases.run_calls, calls)
    assert all(len(r) == n for r in every)
    for per_rank in zip(*every):
        kinds = {r["kind"] for r in per_rank}
        assert len(kinds) == 1, per_rank  # every rank refused (or ran) the same call
        if per_rank[0]["kind"] != "valid":
            assert all(r["message"] for r in per_rank), per_rank
