"""Decoding over a sequence-sharded KV cache (``tokenring.decode``): exact against a float64 single-process
reference for uneven shards (some empty), several new tokens causal among themselves, GQA/MQA, and the
same output bits on every rank; the placement of new tokens; mismatched steps raise on every rank.
Tolerances: float64 1e-9, float32 1e-5 (relative to the reference's max)."""

import cases
import pytest

from tokenring.decode import place_new, step_bytes


def test_place_new_fills_the_emptiest_ranks_in_order():
    assert place_new([5, 5, 5], 1) == [(0, 1), (1, 1), (1, 1)]
    assert place_new([5, 3, 4], 4) == [(0, 1), (1, 3), (3, 4)]  # rows after: 6, 5, 5
    for counts, t in (([0, 0, 0, 0], 7), ([9, 0, 2], 5), ([1], 3)):
        ranges = place_new(counts, t)
        assert ranges[0][0] == 0 and ranges[-1][1] == t
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))  # contiguous, in order
        after = [c + b - a for c, (a, b) in zip(counts, ranges)]
        assert max(after) - min(after) <= max(1, max(counts) - min(counts))


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_decode_matches_reference_and_is_identical_on_every_rank(pools, P):
    for i, (t, H, Hkv, dtype, B) in enumerate(
        [
            (1, 4, 4, "float64", 1),
            (3, 8, 2, "float64", 2),
            (5, 4, 1, "float32", 1),
            (1, 6, 2, "float32", 3),
            (4, 4, 2, "float64", 1),
            (3, 4, 2, "float32", 2),
        ]
    ):
        case = dict(B=B, n=7 * P + 3, t=t, H=H, Hkv=Hkv, d=8 + 4 * i, dtype=dtype, seed=i)
        if i >= 4:  # a zero and a negative softmax_scale (new tokens attend each other causally)
            case["scale"] = (0.0, -0.4)[i - 4]
        if i in (1, 2):  # a sliding window shorter than the cache
            case["window"] = (5, 2 * P + 1)[i - 1]
        got = pools(P).run(cases.decode_case, case) if P > 1 else [cases.decode_case(0, 1, case)]
        tol = 1e-9 if dtype == "float64" else 1e-5
        for out, err in got:
            assert err < tol, (case, err)
            assert out == got[0][0], "ranks disagree"  # bitwise: every rank then picks the same token


def test_decode_mismatch_raises_on_every_rank(pools):
    for msg in pools(3).run(cases.decode_mismatch):
        assert "new tokens" in msg and "rank 0" in msg, msg


def test_step_bytes_formula():
    assert step_bytes(B=2, t=1, H=8, d=64, P=4) == 3 * 2 * 8 * 65 * 4


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_refusal_on_one_rank_raises_everywhere_and_the_next_step_is_exact(pools, kind):
    """Rank 1 alone refuses its arguments before the step's check: every rank raises a ValueError (the others
    naming rank 1), and the group stays in step: a good call right after is exact on every rank."""
    for rank, (msg, err) in enumerate(pools(3).run(cases.refused_then_good, kind)):
        assert ("rank 1" in msg) and (rank == 1 or "refused its arguments" in msg), (rank, msg)
        assert err < 1e-9, (rank, err)
