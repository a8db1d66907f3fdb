"""Double ring (LoongTrain's double-ring attention): ring attention inside each node of ``n`` ranks, and a
second ring that moves K/V between nodes once per round, overlapped with the node's inner ring.

``double_ring:n=8``: ``n`` ranks per node (``tokenring.attention(strategy="double_ring", inner_size=8)`` or
``$LOCAL_WORLD_SIZE``). ``double_ring:direct,c=C,k=K,n=8``: inside the node every rank sends its K/V straight
to every other (an all-gather overlapped with compute, :func:`tokenring.strategies.token_ring.direct_steps`). The
inter-node link carries one K/V block per rank per round instead of one per step. See
:func:`tokenring.strategies.two_level.two_level` for the schedule.
"""

from __future__ import annotations

from .two_level import TwoLevel

__all__ = ["DoubleRing", "STRATEGY"]


class DoubleRing(TwoLevel):
    family, default_mode, mover = "double_ring", "relay", "kv"


STRATEGY = DoubleRing()
