"""State passing for recurrent mixers (tokenring.recurrence) vs the same kernel on the whole sequence in one
process, forward and backward, over world sizes, layouts, packed documents and B=2.

float64 kernels written token by token here check the algebra at 1e-10; transformers' own chunked kernels
(float32 inside, whatever the input dtype) are held to their float32 rounding."""

import pytest
import recurrence_cases as rc

LAYOUTS = [
    ("contiguous", 1),
    ("zigzag", 1),
    ("zigzag", 3),
    ("contiguous", 4),
    ("balanced", 3),
    ("zigzag_docs", 2),
    ("whole_docs", 4),
]


def _check(res, tol):
    for r in res:
        bad = {k: v for k, v in r["errs"].items() if v > tol * r["scale"]}
        assert not bad, (bad, r)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    "kind,kernel", [("delta", "seq_delta"), ("kda", "seq_delta"), ("ssd", "seq_ssd"), ("conv", "")]
)
def test_float64_exact(pools, P, kind, kernel):
    for layout, ndocs in LAYOUTS:
        S = 2 * P * (3 if layout != "balanced" else 16)
        _check(pools(P).run(rc.case, kind, layout, S, ndocs, "float64", kernel), 1e-10)


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kind,kernel", [("delta", "gdn"), ("kda", "kda"), ("ssd", "mamba2")])
def test_transformers_kernels(pools, P, kind, kernel):
    for layout, ndocs in LAYOUTS:
        S = 2 * P * (70 if layout != "balanced" else 16 * 5)
        _check(pools(P).run(rc.case, kind, layout, S, ndocs, "float64", kernel), 2e-5)


def test_tiny_fragments_take_halos_from_several_ranks(pools):
    """One row per fragment at P=5 (zigzag, 10 rows): a width-3 halo spans three fragments on three ranks."""
    _check(pools(5).run(rc.case, "conv", "zigzag", 10, 1, "float64", ""), 1e-12)
    _check(pools(5).run(rc.case, "delta", "zigzag", 10, 1, "float64", "seq_delta"), 1e-10)
