"""TokenRing inside each node of ``n`` ranks, a ring of K/V between nodes.

Inside a node, queries travel and partial outputs go straight home (``relay``: the paper's schedule;
``direct,c=C,k=K``: every rank sends its queries straight to every other in ``c`` chunks, ``k`` blocks ahead,
using every link of a mesh node); between nodes, K/V move one round at a time, overlapped with the node's
work (:func:`tokenring.strategies.two_level.two_level`). ``token_ring_2d:n=8`` lets the cost model pick the
inner variant, like ``token_ring``. Queries and partials never leave the node, so the inter-node link carries
one K/V block per rank per round, as in the double ring.
"""

from __future__ import annotations

from .two_level import TwoLevel

__all__ = ["TokenRing2D", "STRATEGY"]


class TokenRing2D(TwoLevel):
    family, default_mode, mover = "token_ring_2d", "auto", "q"


STRATEGY = TokenRing2D()
