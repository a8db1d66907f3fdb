"""Which strategy a call runs: a named variant itself; for ``"auto"`` or a family choice (``"token_ring"``,
``"ring:auto"``) the variant the cost model (``tokenring.sim``, imported on first use) predicts fastest.
"""

from __future__ import annotations

import torch

from .layouts import default_layout
from .schedules import Shapes
from .strategies import get as get_strategy
from .strategies import node_size, with_node_size

__all__ = ["choose_strategy", "resolve"]


def choose_strategy(
    H: int,
    Hkv: int,
    P: int,
    *,
    B: int = 1,
    s: int | None = None,
    d: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    causal: bool = False,
    layout: str | None = None,
    backward: bool = True,
    device_type: str = "cpu",
    topology=None,
    requested: str = "auto",
    mask=None,
    inner_size: int | None = None,
) -> str:
    """What ``strategy=requested`` (``"auto"``, or a family choice such as ``"token_ring"``) runs for this
    rank's shard shapes on ``P`` ranks: a concrete variant's spec.

    With the local length ``s`` given, the cost model (``tokenring.sim``) simulates every candidate's schedule
    on the group's topology (``tokenring.set_topology``, ``$TOKENRING_TOPOLOGY``, else ``loopback`` on CPU /
    ``h100-nvswitch-8`` on CUDA) and picks the fastest; ``tokenring.explain`` shows the numbers. Ulysses is
    a candidate only when ``H % P == 0``. Without ``s``, the shape-free rule: TokenRing for MHA, pass-KV
    ring for GQA/MQA (K+V is smaller than Q there). ``mask``: a :class:`tokenring.masks.Mask` (packed
    documents, window) the candidates' schedules are cut for. ``inner_size``: ranks per node (default
    ``$LOCAL_WORLD_SIZE``), for the hierarchical strategies."""
    n = node_size(inner_size)
    requested = requested if requested == "auto" else with_node_size(get_strategy(requested), n).name
    if s is None or P < 2:
        if requested != "auto":
            return get_strategy(requested).variants(P)[0].name
        return "token_ring:relay" if H == Hkv else "ring"
    from .sim.auto import choose

    layout = layout or default_layout(causal)
    return choose(
        Shapes(B, s, H, Hkv, d, dtype, P), causal, layout, backward, device_type, topology, requested, mask, n
    )[0]


def resolve(
    strategy: str,
    q_shape,
    k_shape,
    P: int,
    *,
    dtype=torch.bfloat16,
    causal: bool = False,
    layout: str | None = None,
    backward: bool = True,
    device_type: str = "cpu",
    mask=None,
    inner_size: int | None = None,
):
    """The concrete strategy ``tokenring.attention(strategy=...)`` runs for these shard shapes on ``P`` ranks
    (from this process's topology setting; inside ``attention`` rank 0 decides for everyone)."""
    if strategy != "auto":
        st = with_node_size(get_strategy(strategy), node_size(inner_size))
        if st.mode != "auto":
            return st
    B, s, H, d = q_shape
    return get_strategy(
        choose_strategy(
            H,
            k_shape[2],
            P,
            B=B,
            s=s,
            d=d,
            dtype=dtype,
            causal=causal,
            layout=layout,
            backward=backward,
            device_type=device_type,
            requested=strategy,
            mask=mask,
            inner_size=inner_size,
        )
    )
