"""TokenRing inside each node of ``n`` ranks, a ring of K/V between nodes
(:func:`tokenring.strategies.two_level.two_level`; docs/schedules.md, "Two-level schedules").
"""

from __future__ import annotations

from .two_level import TwoLevel

__all__ = ["TokenRing2D", "STRATEGY"]


class TokenRing2D(TwoLevel):
    family, default_mode, mover = "token_ring_2d", "auto", "q"


STRATEGY = TokenRing2D()
