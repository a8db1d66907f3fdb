"""A 100-call sample of the public-API fuzz (tests/fuzz_cases.py; bench/fuzz.py keeps the long run): random
valid calls equal float64 attention, random invalid ones raise a ValueError on every rank and leave the group
usable."""

import fuzz_cases
import pytest


@pytest.mark.parametrize("P,n", [(2, 34), (3, 33), (4, 33)])
def test_fuzz_sample(pools, P, n):
    calls = fuzz_cases.draw_calls(seed=101, P=P, n=n)
    every = pools(P).run(fuzz_cases.run_calls, calls)
    assert all(len(r) == n for r in every)
    for per_rank in zip(*every):
        if per_rank[0]["kind"] != "valid":
            assert all(r["message"] for r in per_rank), per_rank
