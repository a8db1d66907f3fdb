"""Ulysses (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards and back; USP with one node of
all ``P`` ranks (docs/schedules.md, "Ulysses").
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
