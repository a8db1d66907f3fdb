"""A masked call builds only its own rank's part of the schedule (packed documents bring a new mask every
step). That part must be exactly what the rank does in the whole schedule: the same computes, the same messages
posted at the same steps with the same tag numbers, the same reads; else two ranks disagree and hang or
attend to the wrong rows. Checked against the whole schedule for random masks, every strategy, P = 1..7."""

from __future__ import annotations

import random

import pytest

from tokenring.masks import _positions, make_mask, pair_table
from tokenring.schedules import Schedule, Step, drop_empty_tail
from tokenring.strategies import get

SPECS = [
    "token_ring:relay",
    "token_ring:direct,c=1,k=1",
    "token_ring:direct,c=2,k=2",
    "token_ring:direct,c=3,k=1",
    "ring",
    "ring:direct,c=1,k=1",
    "ring:direct,c=2,k=3",
    "ring_bidir",
    "ulysses",
    "usp:n=2",
    "double_ring:n=2",
]


def rank_view(sched: Schedule, r: int) -> Schedule:
    """Rank ``r``'s computes and messages of the whole ``sched``, trailing steps it is idle in dropped (their
    dues then fall on its last step, as in a rank's own build)."""
    steps = [
        Step([c for c in st.computes if c.rank == r], [m for m in st.messages if r in (m.src, m.dst)])
        for st in sched.steps
    ]
    return Schedule(sched.strategy, sched.P, sched.layout, sched.causal, sched.backward, sched.q_kind,
                    drop_empty_tail(steps), sched.mask)  # fmt: skip


def random_mask(rng: random.Random, P: int, layout: str):
    s = 2 * P * rng.randint(1, 3) if layout == "zigzag_docs" else 2 * rng.randint(1, 8)
    S = s * P
    unit = 2 * P if layout == "zigzag_docs" else 1
    n = S // unit
    cuts = sorted(rng.sample(range(1, n), min(rng.randint(0, 6), n - 1))) if n > 1 else []
    window = rng.choice([None, None, (rng.randint(0, 2 * s), -1), (rng.randint(0, s), rng.randint(0, s))])
    causal = rng.random() < 0.6
    return make_mask(S, [0] + [c * unit for c in cuts] + [S], window, causal, force=True), causal


@pytest.mark.parametrize("spec", SPECS)
def test_a_ranks_own_plan_is_its_part_of_the_whole(spec):
    rng = random.Random(spec)
    st = get(spec)
    for trial in range(12):
        P = rng.choice([2, 4, 6]) if spec.startswith(("usp", "double")) else rng.randint(1, 7)
        if spec == "ring_bidir" or (spec == "ulysses" and P > 4):
            P = min(P, 4)
        layout = rng.choice(["contiguous", "zigzag", "zigzag_docs"])
        mask, causal = random_mask(rng, P, layout)
        for backward in (False, True):
            try:
                whole = st.build_schedule(P, layout, causal, backward, mask)
            except ValueError:  # e.g. a lookahead beyond P - 1: refused alike for one rank
                with pytest.raises(ValueError):
                    st.build_schedule(P, layout, causal, backward, mask, 0)
                continue
            for r in range(P):
                own = st.build_schedule(P, layout, causal, backward, mask, r)
                assert own.only in (r, None), own.only
                mine = rank_view(own, r)
                want = rank_view(whole, r)
                where = (spec, trial, P, layout, mask.bounds, mask.left, mask.right, causal, backward, r)
                for early in (False, True):
                    assert mine.postings(r, early) == want.postings(r, early), where
                assert mine.reads(r) == want.reads(r), where
                assert len(mine.steps) == len(want.steps), where


def test_pair_table_of_one_rank_equals_the_whole_one():
    rng = random.Random(5)
    for _ in range(40):
        P = rng.randint(1, 9)
        layout = rng.choice(["contiguous", "zigzag", "zigzag_docs"])
        mask, _ = random_mask(rng, P, layout)
        whole = pair_table(mask, P, layout)
        for r in range(P):
            mine = pair_table(mask, P, layout, r)
            for x in range(P):
                assert mine.get(r, x) == whole.get(r, x) and mine.get(x, r) == whole.get(x, r)
                want = mask.pair(_positions(mask, P, layout, r), _positions(mask, P, layout, x))
                assert whole.get(r, x) == want
            if P > 2:
                with pytest.raises(KeyError):
                    mine.get((r + 1) % P, (r + 2) % P)


def test_a_rank_plan_is_refused_for_another_rank():
    mask = make_mask(16, [0, 5, 16], None, True)
    mine = get("token_ring:relay").build_schedule(2, "zigzag", True, False, mask, 0)
    with pytest.raises(ValueError, match="built for rank 0"):
        mine.postings(1)
