"""Strategy registry: name -> strategy object (``forward``/``backward`` and their schedule builders)."""
from . import ring, token_ring, ulysses

STRATEGIES = {
    "token_ring": token_ring.STRATEGY,
    "ring": ring.STRATEGY,
    "ulysses": ulysses.STRATEGY,
    "ring_bidir": ring.BIDIR,
}

__all__ = ["STRATEGIES"]
