"""TokenRing (pass-Q, return partials): K/V stay home, queries travel, partial results go straight home.

Two schedules (``token_ring:relay`` / ``token_ring_paper``, and ``token_ring:direct,c=C,k=K``);
``strategy="token_ring"`` runs the one the cost model predicts fastest on the topology (see
:func:`tokenring.set_topology`), decided on rank 0.

``direct`` (:func:`tokenring.schedules.direct` with ``mover="q"``): each owner sends its queries straight to
every rank, in ``c`` row chunks, up to ``k`` blocks ahead, so on a full mesh all links carry queries at once;
each chunk's partial goes home one step after it is computed, and the last own rows are computed at the end,
hiding the last partial's trip. ::

    rank r, steps:   0         1 .. c        c+1 .. 2c    ...   (P-1)c + 1
    compute        own rows   Q_{r+1} chunks Q_{r+2} chunks      own last rows
    receive        Q chunks (from their owners, k blocks ahead) + partials of Q_r (from whoever computed them)
    send           Q_r chunks to every rank + the partial of the chunk computed one step earlier, to its owner

``relay`` (the paper's schedule):

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

from ..schedules import Compute, Message, Schedule, Step, drop_empty_tail, pairing, relay
from .base import RelayOrDirect

__all__ = ["TokenRing", "pass_q_steps", "STRATEGY"]


def _pass_q(P: int, layout: str, causal: bool, backward: bool, mask=None) -> Schedule:
    steps = pass_q_steps(P, pairing(P, layout, causal, mask), backward)
    carry = "qgrad" if backward else "q"
    return Schedule("token_ring:relay", P, layout, causal, backward, carry, drop_empty_tail(steps), mask)


def pass_q_steps(P: int, pair, backward: bool) -> list[Step]:
    """The steps of the relay schedule for blocks that meet as ``pair(q_owner, kv_owner)`` says."""
    carry, ret = ("qgrad", "dq") if backward else ("q", "out")
    steps = [Step() for _ in range(P + 1)]  # the extra step only returns the last partials
    for t in range(P):
        for r in range(P):
            j = (r + t) % P
            got = pair(j, r)
            if got is None:
                continue
            q_part, kv_part, diag = got
            steps[t].computes.append(Compute(r, j, q_part, r, kv_part, diag))
            if j != r:
                steps[t + 1].messages.append(Message(r, j, ret, j, q_part))
    for j in range(P):
        path = [(j - t) % P for t in range(1, P)]
        needs = [(got[0] if got else None) for got in (pair(j, r) for r in path)]
        for t, m in relay(j, path, needs, carry):
            steps[t].messages.append(m)
    return steps


class TokenRing(RelayOrDirect):
    """``token_ring`` alone: the variant the cost model picks; ``token_ring:relay``: the paper's schedule;
    ``token_ring:direct,c=C,k=K``: the direct one."""
    family, default_mode, mover = "token_ring", "auto", "q"

    def relay_schedule(self, P: int, layout: str, causal: bool, backward: bool, mask=None) -> Schedule:
        return _pass_q(P, layout, causal, backward, mask)


STRATEGY = TokenRing()
