"""Ulysses (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards and back.

Step 0 sends rank ``p`` the ``p``-th group of ``H/P`` query heads (and ``Hkv'/P`` K/V heads) of my rows; step
1 runs full-sequence attention on my head group; step 2 returns each rank its rows of my heads. K/V heads
are repeated beforehand (in ``prepare``, differentiably) to ``Hkv'``, the fewest that split evenly over ``P``.
The all-to-alls are point-to-point messages run by the same executor as the rings, so they share byte
accounting, timeouts and traces, and the simulator sees them too.

It is USP (:mod:`.usp`) with a single node of all ``P`` ranks: the ring over nodes shrinks to one compute.
"""

from __future__ import annotations

from .usp import Usp

__all__ = ["Ulysses", "STRATEGY"]


class Ulysses(Usp):
    name = family = "ulysses"
    hierarchical = False
    PARAMS = ()

    def __init__(self):
        self.inner = 0  # flat: the head exchange spans the whole group

    def node_size(self, P: int) -> int:
        return P

    def check(self, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
        if H % P:
            return (
                f"strategy='ulysses' needs the {H} query heads to divide over {P} ranks (H % P == 0); "
                f"use strategy='token_ring' or 'ring', or a group size that divides {H}"
            )
        return None


STRATEGY = Ulysses()
