"""examples/token_ring_minimal.py (the 100-line TokenRing for learning) equals tokenring.attention."""

import pytest
from minimal_cases import minimal_vs_library


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_minimal_token_ring_equals_library(pools, P, causal):
    errs = pools(P).run(minimal_vs_library, causal, 24, 3, 20)
    assert max(errs) < 1e-10, errs
