"""TokenRing (pass-Q, return partials): K/V stay home, queries travel, partial results go straight home.

``token_ring:relay`` (the paper's schedule) and ``token_ring:direct,c=C,k=K``; ``token_ring`` alone runs the one
the cost model predicts fastest. The schedules, with a worked plan at P=3: docs/schedules.md, "TokenRing".
"""

from __future__ import annotations

from ..schedules import (
    Compute,
    Message,
    Schedule,
    Step,
    drop_empty_tail,
    pairing,
    relay,
    relay_through,
)
from .base import RelayOrDirect

__all__ = ["TokenRing", "pass_q_steps", "STRATEGY"]


def _pass_q(P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None) -> Schedule:
    steps = pass_q_steps(P, pairing(P, layout, causal, mask), backward, only)
    carry = "qgrad" if backward else "q"
    return Schedule("token_ring:relay", P, layout, causal, backward, carry, drop_empty_tail(steps), mask, only)


def pass_q_steps(P: int, pair, backward: bool, only: int | None = None) -> list[Step]:
    """The relay schedule's steps for blocks that meet as ``pair`` says (``only``: that rank's part alone)."""
    carry, ret = ("qgrad", "dq") if backward else ("q", "out")
    steps = [Step() for _ in range(P + 1)]
    for t in range(P):
        for r in range(P) if only is None else sorted({only, (only - t) % P}):
            j = (r + t) % P
            got = pair(j, r)
            if got is None:
                continue
            q_part, kv_part, diag = got
            if only in (None, r):
                steps[t].computes.append(Compute(r, j, q_part, r, kv_part, diag))
            if j != r:
                steps[t + 1].messages.append(Message(r, j, ret, j, q_part))
    table = getattr(pair, "table", None)
    for j in range(P):
        path = [(j - t) % P for t in range(1, P)]
        if only is not None and table is not None:
            hops = relay_through(j, path, table.needs(j, "q"), carry, only, pair.s)
        else:
            needs = [(got[0] if got else None) for got in (pair(j, r) for r in path)]
            hops = [(t, m) for t, m in relay(j, path, needs, carry) if only in (None, m.src, m.dst)]
        for t, m in hops:
            steps[t].messages.append(m)
    return steps


class TokenRing(RelayOrDirect):
    """``token_ring`` alone: the variant the cost model picks; ``token_ring:relay``: the paper's schedule;
    ``token_ring:direct,c=C,k=K``: the direct one."""

    family, default_mode, mover = "token_ring", "auto", "q"

    def relay_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        return _pass_q(P, layout, causal, backward, mask, only)


STRATEGY = TokenRing()
