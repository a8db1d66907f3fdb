"""Double ring (LoongTrain's double-ring attention): ring attention inside each node of ``n`` ranks, and a
second ring that moves K/V between nodes once per round (docs/schedules.md, "Two-level schedules").
"""

from __future__ import annotations

from .two_level import TwoLevel

__all__ = ["DoubleRing", "STRATEGY"]


class DoubleRing(TwoLevel):
    family, default_mode, mover = "double_ring", "relay", "kv"


STRATEGY = DoubleRing()
