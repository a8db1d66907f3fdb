"""``layout="auto"``: the placement of a packed batch (``zigzag``, ``contiguous``, ``balanced`` or ``whole_docs``)
that the cost model predicts fastest for its documents.

The choice is a pure function of the global length, the ranks, the documents and two settings, so every rank and
every entry point (``shard``, ``gather``, ``attention``, the HF layers and ``shard_batch``) reaches the same
answer without a message; ``attention``'s agreement compares the layouts the ranks resolved. It does not depend
on the device: a batch sharded on the CPU and attended on a GPU must be placed alike. So the topology is the one
set (``tokenring.set_topology``, ``$TOKENRING_TOPOLOGY``) or else :data:`REFERENCE_TOPOLOGY`, and the layer is
the one set (``tokenring.configure(layer=(H, Hkv, d))``, ``$TOKENRING_LAYER``; the HF Trainer sets it from the
model's config) or else a reference one (:data:`REFERENCE_HEADS`); a CPU topology's kernels are modelled as
``strategy="auto"`` models them, for this process's thread count (the same on every rank, as a rule). Each
candidate is timed forward+backward under ring, Ulysses and TokenRing variants (:func:`strategies`), its best
time counting; a later candidate must be predicted :data:`TIE` faster than the best before it.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import settings
from ..layouts import auto_inputs, padded_length
from ..masks import make_mask
from ..schedules import Shapes

__all__ = [
    "choose_layout",
    "placement_times",
    "layer",
    "strategies",
    "CANDIDATES",
    "REFERENCE_TOPOLOGY",
    "REFERENCE_HEADS",
]

CANDIDATES = ("zigzag", "contiguous", "balanced", "whole_docs")  # in the order ties go
REFERENCE_TOPOLOGY = "h200-nvswitch-8"  # without a topology set: an 8-GPU NVSwitch node, calibrated H200 kernels
REFERENCE_HEADS = (32, 8, 128)  # H, Hkv, d of the layer the placements are timed on (an 8B model's), bf16
TIE = 0.04  # a later candidate must be predicted this much faster to be chosen (the default, zigzag, first)


def strategies(sh: Shapes, layout: str) -> list[str]:
    """The schedules a placement is timed under, those of them that can run it: Ulysses, and ring and TokenRing
    sending to their next peer, to half of them and to all at once (the variants ``auto`` picks most often on
    packed batches: bench/results/auto_layout.md)."""
    from .simulator import variant_candidates

    P, half = sh.P, max(1, sh.P // 2)
    short = ["ulysses"]
    for family, first in (("ring", "ring"), ("token_ring", "token_ring:relay")):
        short += [first, f"{family}:direct,c=1,k={half}", f"{family}:direct,c=1,k={P - 1}"]
    can = set(variant_candidates("auto", sh, True, layout))
    return [n for n in dict.fromkeys(short) if n in can] or ["ring"]


def choose_layout(S: int, P: int, bounds: tuple[int, ...]) -> str:
    """The placement of ``S`` tokens in documents ``bounds`` (``cu_seqlens``, from 0 to ``S``) over ``P`` ranks
    predicted fastest (ties to the earlier of :data:`CANDIDATES`)."""
    return _choose(S, P, tuple(bounds), auto_inputs())


def layer() -> tuple[int, int, int]:
    """(H, Hkv, d) of the layer placements are timed on: the ``layer`` setting, else :data:`REFERENCE_HEADS`."""
    return settings.get("layer") or REFERENCE_HEADS


@lru_cache(maxsize=256)
def _choose(S: int, P: int, bounds: tuple[int, ...], inputs: tuple) -> str:
    times = placement_times(S, P, bounds)
    best = CANDIDATES[0]
    for lay in CANDIDATES[1:]:
        if times[lay] < times[best] * (1 - TIE):
            best = lay
    return best


def placement_times(S: int, P: int, bounds: tuple[int, ...], topology=None) -> dict[str, float]:
    """Predicted seconds of one causal forward+backward call per candidate placement (the best of
    :func:`strategies`), on ``topology`` (default: the one set, else :data:`REFERENCE_TOPOLOGY`)."""
    from .kernel_model import kernel_model
    from .simulator import simulate
    from .topology import get_topology

    spec = topology if topology is not None else settings.get("topology")
    topo = get_topology(spec if spec is not None else REFERENCE_TOPOLOGY, P)
    if topo.kernel is not None:  # a calibration profile's measured kernels
        km = topo.kernel
    elif spec is None:
        km = kernel_model("h200", calibrated=True, dtype=torch.bfloat16)
    else:  # as strategy="auto" models it (CPU ranks: this process's threads, sharing the host's cores)
        from .auto import _kernel

        km = _kernel(topo, P)
    H, Hkv, d = layer()
    out = {}
    for lay in CANDIDATES:
        Sp = padded_length(S, P, lay)  # as shard cuts any length: padding at the end, a document of its own
        docs = tuple(bounds) + ((Sp,) if Sp > S else ())
        mask = make_mask(Sp, list(docs), None, True, force=True)
        sh = Shapes(1, Sp // P, H, Hkv, d, torch.bfloat16, P)
        out[lay] = min(
            simulate(st, sh, topo, km, causal=True, layout=lay, backward=True, mask=mask).time
            for st in strategies(sh, lay)
        )
    return out
