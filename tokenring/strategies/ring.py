"""Ring attention (pass-KV): queries stay home, K/V travel ``r -> r + 1`` one hop per step.

At step ``t`` rank ``r`` attends its queries to the K/V of ``i = r - t`` and merges the partial locally.
Backward: K/V travel the same way; dQ accumulates locally; the dK/dV of ``K/V_i`` accumulate (in float32) in
a buffer that travels with them from one contributing rank to the next and finally to ``i``.

:func:`pass_kv` takes *lanes*: ``(head half, direction)`` pairs; ring is one lane, ``ring_bidir`` two.

``ring:direct,c=C,k=K`` (:func:`tokenring.strategies.token_ring.direct` with ``mover="kv"``): every owner sends its K/V
straight to every rank in ``c`` row chunks, up to ``k`` blocks ahead (``k = P-1``: an all-gather overlapped
with compute); partials merge locally, and in backward each chunk's dK/dV goes straight home. ``ring`` alone
is the classic ring above; ``ring:auto`` lets the cost model pick among the variants.
"""

from __future__ import annotations

from ..schedules import Compute, Message, Schedule, Step, drop_empty_tail, pairing, part_union, relay
from .base import RelayOrDirect

__all__ = ["pass_kv", "pass_kv_steps", "Ring", "STRATEGY"]

ONE_WAY = (("all", +1),)


def pass_kv(
    P: int, layout: str, causal: bool, backward: bool, lanes=ONE_WAY, name: str = "ring", mask=None
) -> Schedule:
    steps = pass_kv_steps(P, pairing(P, layout, causal, mask), backward, lanes)
    return Schedule(name, P, layout, causal, backward, "qgrad" if backward else "q", drop_empty_tail(steps), mask)


def pass_kv_steps(P: int, pair, backward: bool, lanes=ONE_WAY) -> list[Step]:
    """The steps of :func:`pass_kv` for blocks that meet as ``pair(q_owner, kv_owner)`` says."""
    steps = [Step() for _ in range(P + 1)]  # the extra step only brings the last dK/dV home
    for i in range(P):
        own = pair(i, i)
        if own is not None:
            steps[0].computes.append(Compute(i, i, own[0], i, own[1], own[2]))
        for heads, sign in lanes:
            path = [(i + sign * t) % P for t in range(1, P)]
            pairs = [pair(r, i) for r in path]
            for t, (r, got) in enumerate(zip(path, pairs), start=1):
                if got is not None:
                    steps[t].computes.append(Compute(r, r, got[0], i, got[1], got[2], heads=heads))
            for t, m in relay(i, path, [(p[1] if p else None) for p in pairs], "kv", heads):
                steps[t].messages.append(m)
            if backward:
                # The dK/dV accumulator of K/V_i goes from each contributor to the next one, then home to i.
                acc_part, holder, t_held = None, None, 0
                for t, (r, got) in enumerate(zip(path, pairs), start=1):
                    if got is None:
                        continue
                    if holder is not None:
                        steps[t_held + 1].messages.append(Message(holder, r, "dkv", i, acc_part, heads))
                    acc_part, holder, t_held = part_union(acc_part, got[1]), r, t
                if holder is not None:
                    steps[t_held + 1].messages.append(Message(holder, i, "dkv", i, acc_part, heads))
    # Computes were appended per K/V owner; order them by rank for readable traces (semantics unaffected).
    for st in steps:
        st.computes.sort(key=lambda c: c.rank)
    return steps


class Ring(RelayOrDirect):
    """``ring`` alone: the classic ring; ``ring:direct,c=C,k=K``: the direct one; ``ring:auto``: the cost
    model picks."""

    family, default_mode, mover = "ring", "relay", "kv"

    def relay_schedule(self, P: int, layout: str, causal: bool, backward: bool, mask=None) -> Schedule:
        return pass_kv(P, layout, causal, backward, mask=mask)


STRATEGY = Ring()
