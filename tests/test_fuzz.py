"""Hypothesis shape fuzzing: random batch, local length, heads, head dim, scale, layout and strategy (direct
variants with random chunks and lookahead included) on 2 and 3 ranks, float64, forward and backward against the
float64 reference (relative error <= 1e-9)."""

import cases
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenring.strategies import why_not


@st.composite
def configs(draw, P):
    Hkv = draw(st.sampled_from([1, 2, 3]))
    H = Hkv * draw(st.sampled_from([1, 2, 3]))
    causal = draw(st.booleans())
    layout = draw(st.sampled_from(["contiguous", "zigzag"]))
    s = 2 * draw(st.integers(1, 6))
    c, k = draw(st.integers(1, 3)), draw(st.integers(1, P - 1))
    names = [
        "token_ring",
        "token_ring_paper",
        "ring",
        "ulysses",
        "ring_bidir",
        f"token_ring:direct,c={c},k={k}",
        f"ring:direct,c={c},k={k}",
    ]
    names = [n for n in names if why_not(n, H, Hkv, P, s, causal and layout == "zigzag") is None]
    return dict(
        B=draw(st.integers(1, 3)),
        s=s,
        H=H,
        Hkv=Hkv,
        d=draw(st.integers(1, 40)),
        dtype="float64",
        causal=causal,
        layout=layout,
        strategy=draw(st.sampled_from(names)),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("P", [2, 3])
def test_fuzz_shapes(pools, P):
    pool = pools(P)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(configs(P))
    def run(case):
        pool.run(cases.check_case, case)

    run()
