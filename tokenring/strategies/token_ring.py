"""TokenRing (pass-Q, return partials): K/V stay home, queries travel, partial results go straight home.

Two schedules (``token_ring:relay`` / ``token_ring_paper``, and ``token_ring:direct,c=C,k=K``);
``strategy="token_ring"`` runs the one the cost model predicts fastest on the topology (see
:func:`tokenring.set_topology`), decided on rank 0.

``direct`` (:func:`tokenring.strategies.direct.direct`, ``mover="q"``): each owner sends its queries straight
to every rank, in ``c`` row chunks, up to ``k`` blocks ahead, so on a full mesh all links carry queries at
once; each chunk's partial goes home one step after it is computed, and the last own rows are computed at the
end, hiding the last partial's trip.

Note [the direct schedule at P=3]
    ``tokenring explain --plan --strategy token_ring:direct,c=1,k=1 --ranks 3 --pass fwd``. Odd P: the ranks
    meet in P rounds of pairs, one rank sitting out each round (a *bye*, spent on more of its own rows).
    ``Qj.a:b/3``: rows a/3..b/3 of rank j's queries; ``out(j)``: the partial of Q_j going home. ::

        step  rank 0                    rank 1                    rank 2
        0     Q0.0:1/3 x KV0            Q1.0:1/3 x KV1            Q2.0:1/3 x KV2
              -                         q(1)->2  q(2)<-2          q(2)->1  q(1)<-1
        1     Q0.1:2/3 x KV0 (bye)      Q2 x KV1                  Q1 x KV2
              q(0)->2  q(2)<-2          -                         q(2)->0  q(0)<-0
        2     Q2 x KV0                  Q1.1:2/3 x KV1 (bye)      Q0 x KV2
              q(0)->1  q(1)<-1          out(2)->2 q(1)->0 ...     out(1)->1  out(2)<-1
        3     Q1 x KV0                  Q0 x KV1                  Q2.1:2/3 x KV2 (bye)
              out(2)->2  out(0)<-2      -                         out(0)->0  out(2)<-0
        4     Q0.2:3/3 x KV0            Q1.2:3/3 x KV1            Q2.2:3/3 x KV2
              out(1)->1  out(0)<-1      out(0)->0  out(1)<-0      -

    Every query block is computed where its keys live; every partial goes straight home over its own link;
    the last own rows (step 4) hide the last partials' trip.

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
    """The steps of the relay schedule for blocks that meet as ``pair(q_owner, kv_owner)`` says (``only``:
    just what rank ``only`` computes, sends and receives)."""
    carry, ret = ("qgrad", "dq") if backward else ("q", "out")
    steps = [Step() for _ in range(P + 1)]  # the extra step only returns the last partials
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
