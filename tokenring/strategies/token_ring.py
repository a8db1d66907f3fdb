"""TokenRing (pass-Q, return partials): K/V stay home, queries travel, partial results go straight home.

At step ``t`` rank ``r`` holds the queries of ``j = r + t`` (they travel ``r + 1 -> r``, one hop per step),
attends them to its own K/V, and during step ``t + 1`` sends the partial ``(out, lse)`` directly to ``j``
while it computes the next block. Queries use the link towards ``r - 1``, partials the links towards their
owners, so on a full mesh the two flows never share a link. With zigzag the path of ``Q_j`` visits first
every rank before ``j`` (needs all of ``Q_j``) and then every rank after it (needs only the second half), so
after the wrap only half of ``Q_j`` travels and only half-size partials return.

Backward: ``(Q, dO, lse, delta)`` take the same path; each visited rank accumulates dK/dV for its own K/V
locally and returns the partial dQ straight to the owner.
"""
from __future__ import annotations

from ..schedules import Compute, Message, Schedule, Step, block_pair, relay
from .base import ScheduledStrategy

__all__ = ["forward_schedule", "backward_schedule", "STRATEGY"]


def _pass_q(P: int, layout: str, causal: bool, backward: bool) -> Schedule:
    carry, ret = ("qgrad", "dq") if backward else ("q", "out")
    steps = [Step() for _ in range(P + 1)]  # the extra step only returns the last partials
    for t in range(P):
        for r in range(P):
            j = (r + t) % P
            pair = block_pair(j, r, P, layout, causal)
            if pair is None:
                continue
            q_part, kv_part, diag = pair
            steps[t].computes.append(Compute(r, j, q_part, r, kv_part, diag))
            if j != r:
                steps[t + 1].messages.append(Message(r, j, ret, j, q_part))
    for j in range(P):
        path = [(j - t) % P for t in range(1, P)]
        needs = [(pair[0] if pair else None) for pair in (block_pair(j, r, P, layout, causal) for r in path)]
        for t, m in relay(j, path, needs, carry):
            steps[t].messages.append(m)
    return Schedule("token_ring", P, layout, causal, backward, carry, _drop_empty_tail(steps))


def _drop_empty_tail(steps: list[Step]) -> list[Step]:
    while steps and not steps[-1].computes and not steps[-1].messages:
        steps.pop()
    return steps


def forward_schedule(P: int, layout: str, causal: bool) -> Schedule:
    return _pass_q(P, layout, causal, backward=False)


def backward_schedule(P: int, layout: str, causal: bool) -> Schedule:
    return _pass_q(P, layout, causal, backward=True)


STRATEGY = ScheduledStrategy("token_ring", forward_schedule, backward_schedule)
