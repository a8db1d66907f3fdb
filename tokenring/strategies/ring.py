"""Ring attention (pass-KV): queries stay home, K/V travel ``r -> r + 1`` one hop per step.

At step ``t`` rank ``r`` attends its queries to the K/V of ``i = r - t`` and merges the partial locally.
Backward: K/V travel the same way; dQ accumulates locally; the dK/dV of ``K/V_i`` accumulate (in float32) in
a buffer that travels with them from one contributing rank to the next and finally to ``i``.
"""
from __future__ import annotations

from ..schedules import Compute, Message, Schedule, Step, block_pair, part_union, relay
from .base import ScheduledStrategy
from .token_ring import _drop_empty_tail

__all__ = ["forward_schedule", "backward_schedule", "STRATEGY"]


def _pass_kv(P: int, layout: str, causal: bool, backward: bool) -> Schedule:
    steps = [Step() for _ in range(P + 1)]  # the extra step only brings the last dK/dV home
    for i in range(P):
        path = [(i + t) % P for t in range(1, P)]
        pairs = [block_pair(r, i, P, layout, causal) for r in path]
        own = block_pair(i, i, P, layout, causal)
        steps[0].computes.append(Compute(i, i, own[0], i, own[1], own[2]))
        for t, (r, pair) in enumerate(zip(path, pairs), start=1):
            if pair is not None:
                steps[t].computes.append(Compute(r, r, pair[0], i, pair[1], pair[2]))
        for t, m in relay(i, path, [(p[1] if p else None) for p in pairs], "kv"):
            steps[t].messages.append(m)
        if backward:
            # The dK/dV accumulator of K/V_i goes from each contributor to the next one, then home to i.
            acc_part, holder = None, None
            for t, (r, pair) in enumerate(zip(path, pairs), start=1):
                if pair is None:
                    continue
                if holder is not None:
                    steps[t_held + 1].messages.append(Message(holder, r, "dkv", i, acc_part))
                acc_part, holder, t_held = part_union(acc_part, pair[1]), r, t
            if holder is not None:
                steps[t_held + 1].messages.append(Message(holder, i, "dkv", i, acc_part))
    # Computes were appended per K/V owner; order them by rank for readable traces (semantics unaffected).
    for st in steps:
        st.computes.sort(key=lambda c: c.rank)
    return Schedule("ring", P, layout, causal, backward, "qgrad" if backward else "q", _drop_empty_tail(steps))


def forward_schedule(P: int, layout: str, causal: bool) -> Schedule:
    return _pass_kv(P, layout, causal, backward=False)


def backward_schedule(P: int, layout: str, causal: bool) -> Schedule:
    return _pass_kv(P, layout, causal, backward=True)


STRATEGY = ScheduledStrategy("ring", forward_schedule, backward_schedule)
