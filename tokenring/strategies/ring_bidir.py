"""Bidirectional pass-KV: half of the K/V heads travel ``r -> r + 1``, the other half ``r -> r - 1``; needs an
even ``Hkv`` (docs/schedules.md, "Ring attention").
"""

from __future__ import annotations

from ..schedules import Schedule
from .base import ScheduledStrategy
from .ring import pass_kv

__all__ = ["RingBidir", "STRATEGY"]

TWO_WAY = (("h0", +1), ("h1", -1))  # (head half, direction its K/V travel)


class RingBidir(ScheduledStrategy):
    name = "ring_bidir"

    def check(self, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
        if Hkv % 2:
            return (
                f"strategy='ring_bidir' sends half of the K/V heads each way and needs an even number of "
                f"key/value heads, got {Hkv}; use strategy='ring' (or 'token_ring')"
            )
        return None

    def build_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        return pass_kv(P, layout, causal, backward, TWO_WAY, self.name, mask, only)


STRATEGY = RingBidir()
