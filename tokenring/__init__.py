"""TokenRing: exact attention over sequences sharded across devices.

    out = tokenring.attention(q, k, v, causal=True)        # q: (B, s, H, d) shard, k/v: (B, s, Hkv, d)
    x_local = tokenring.shard(x_full, dim=1, layout="zigzag")
    x_full = tokenring.gather(x_local, dim=1, layout="zigzag")
    out = tokenring.attention(q, k, v, causal=True, cu_seqlens=cu, window=(4095, 0))   # packed docs, a window
    out = tokenring.decode_attention(q_new, k_rows, v_rows)   # new tokens over a sequence-sharded KV cache
    out = tokenring.extend_attention(q_mine, k_rows, v_rows, new=(a, b))   # a turn's new tokens, sharded too
    with tokenring.context_parallel(buffers=[tokens], seq_dims=[1]): model(tokens)   # any model's SDPA calls

The cost model behind ``strategy="auto"`` (``tokenring.sim``) is imported on first use only.
"""

from . import layouts, ops, settings
from .api import STRATEGY_NAMES, attention, choose_strategy, forget_choices
from .comm import get_timeout, set_timeout
from .context import context_parallel
from .decode import decode_attention
from .extend import extend_attention
from .instrument import instrument
from .layouts import gather, local_positions, shard, shard_positions
from .settings import options

__version__ = "0.1.0"
__all__ = [
    "attention",
    "decode_attention",
    "extend_attention",
    "context_parallel",
    "shard",
    "gather",
    "local_positions",
    "shard_positions",
    "choose_strategy",
    "forget_choices",
    "explain",
    "calibrate",
    "set_topology",
    "get_current_topology",
    "set_timeout",
    "get_timeout",
    "configure",
    "options",
    "instrument",
    "STRATEGY_NAMES",
    "__version__",
]

_LAZY = {"explain", "set_topology", "get_current_topology"}  # from tokenring.sim.auto, imported when first used


def _calibrate_group(group, q, k) -> None:
    from .calibration import calibrate_group  # the calibration (and the cost model) load on first use

    calibrate_group(group, q, k)


ops.set_calibrator(_calibrate_group)


def _choose_layout(S: int, P: int, bounds: tuple[int, ...]) -> str:
    from .sim.placement import choose_layout  # layout="auto": the cost model loads on first use

    return choose_layout(S, P, bounds)


layouts.set_placement_chooser(_choose_layout)


def configure(**values) -> None:
    """:func:`tokenring.settings.configure`, with a topology's name checked by the cost model."""
    if values.get("topology") is not None:
        from .sim import topology  # noqa: F401  (registers the check)
    settings.configure(**values)


def __getattr__(name: str):
    if name in _LAZY:
        from .sim import auto

        return getattr(auto, name)
    if name == "calibrate":
        from .calibration import calibrate

        return calibrate
    raise AttributeError(f"module 'tokenring' has no attribute {name!r}")
