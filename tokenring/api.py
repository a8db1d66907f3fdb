"""Public entry point: ``tokenring.attention`` — validation and dispatch to a strategy."""
from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import get_timeout
from .layouts import LAYOUTS, check_layout, group_info
from .schedules import Shapes, ulysses_kv_heads
from .strategies import STRATEGIES
from .strategies.base import Config, ScheduledAttention

__all__ = ["attention", "choose_strategy", "STRATEGY_NAMES"]

STRATEGY_NAMES = tuple(STRATEGIES) + ("auto",)
_checked: set = set()  # (group, signature) pairs already verified identical on every rank


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
    where = f"rank {rank}: "
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{where}{name} has shape {tuple(t.shape)}; expected 4 dims (batch, seq_local, heads, "
                             f"head_dim), the flash-attn layout")
    if k.shape != v.shape:
        raise ValueError(f"{where}k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    B, s, H, d = q.shape
    for what, i, name in (("batch", 0, "batch size"), ("seq_local", 1, "local sequence length"),
                          ("head_dim", 3, "head dim")):
        if k.shape[i] != q.shape[i]:
            raise ValueError(f"{where}q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in {name} (dim {i}, "
                             f"{what}); q and k/v must be shards of the same tokens")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{where}q has {H} heads and k/v {Hkv}: the query heads must be a multiple of the "
                         f"key/value heads (MHA: equal, GQA: H % Hkv == 0, MQA: Hkv == 1)")
    if s == 0 or B == 0:
        raise ValueError(f"{where}q has shape {tuple(q.shape)}: batch and local length must be positive")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not q.is_floating_point():
        raise ValueError(f"{where}q has dtype {q.dtype}; attention needs floating point inputs")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}q, k, v are on different devices ({q.device}, {k.device}, {v.device}); "
                         f"move them to one device")


def choose_strategy(H: int, Hkv: int, P: int, *, B: int = 1, s: int | None = None, d: int = 128,
                    dtype: torch.dtype = torch.bfloat16, causal: bool = False, layout: str | None = None,
                    backward: bool = True, device_type: str = "cpu", topology=None) -> str:
    """What ``strategy="auto"`` runs for this rank's shard shapes on ``P`` ranks.

    With the local length ``s`` given, the cost model (``tokenring.sim``) simulates every candidate's schedule
    on the group's topology (``tokenring.set_topology``, ``$TOKENRING_TOPOLOGY``, else ``loopback`` on CPU /
    ``h100-nvswitch-8`` on CUDA) and picks the fastest; ``tokenring.explain`` shows the numbers. Ulysses is
    a candidate only when ``H % P == 0``. Without ``s``, the shape-free rule: TokenRing for MHA, pass-KV
    ring for GQA/MQA (K+V is smaller than Q there)."""
    if s is None or P < 2:
        return "token_ring" if H == Hkv else "ring"
    from .sim.auto import choose
    layout = layout or ("zigzag" if causal else "contiguous")
    return choose(Shapes(B, s, H, Hkv, d, dtype, P), causal, layout, backward, device_type, topology)[0]


def _code(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes, unlike hash()


def _signature(q, k, causal, layout, strategy, scale, resolved) -> list[float]:
    B, s, H, d = q.shape
    return [B, s, H, k.shape[2], d, _code(str(q.dtype)), _code(q.device.type),
            float(causal), LAYOUTS.index(layout), STRATEGY_NAMES.index(strategy), scale,
            STRATEGY_NAMES.index(resolved)]


_FIELDS = ["batch", "local length", "query heads", "key/value heads", "head dim", "dtype", "device type",
           "causal", "layout", "strategy", "softmax_scale",
           "strategy chosen by auto (set the same tokenring.set_topology / $TOKENRING_TOPOLOGY on every rank)"]


def _show(field: str, value: float) -> str:
    if field == "strategy" or field.startswith("strategy chosen"):
        return STRATEGY_NAMES[int(value)]
    return f"{value:g}" if field in ("softmax_scale",) else str(int(value))


def _check_across_ranks(sig: list[float], describe: str, group, device, rank: int, P: int) -> None:
    """Verify every rank calls with the same shapes and options, once per (group, signature)."""
    key = (id(group), tuple(sig))
    if key in _checked:
        return
    mine = torch.tensor(sig, dtype=torch.float64, device=device)
    allsig = [torch.empty_like(mine) for _ in range(P)]
    work = dist.all_gather(allsig, mine, group=group, async_op=True)
    try:
        work.wait(datetime.timedelta(seconds=get_timeout()))
    except Exception as e:
        raise RuntimeError(
            f"tokenring: rank {rank} could not compare call signatures with the other ranks within "
            f"{get_timeout():.0f} s ({e}). A rank has died, or is not calling tokenring.attention at this point "
            f"(every rank of the group must call it with the same shapes and options).") from e
    for r, other in enumerate(allsig):
        bad = [f"{f} ({_show(f, a)} on rank {r}, {_show(f, b)} on rank {rank})"
               for f, a, b in zip(_FIELDS, other.tolist(), sig) if a != b]
        if bad:
            raise ValueError(
                f"tokenring: rank {r} calls attention with a different {'; '.join(bad)}; here: {describe}. "
                f"Every rank must pass shards of the same shape, dtype and options; shard the sequence with "
                f"tokenring.shard() so local lengths are equal.")
    _checked.add(key)


def _single_device(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: float | None = None, strategy: str = "auto", layout: str | None = None,
              group=None, _config: dict | None = None) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    ``q``: (B, s, H, d), ``k``/``v``: (B, s, Hkv, d), this rank's shard (laid out by ``layout``; default
    ``"zigzag"`` when causal, else ``"contiguous"``, and it must match how the caller sharded). Returns
    (B, s, H, d) in ``q.dtype``: the same rows of single-device attention over the whole sequence.
    Differentiable in ``q``, ``k``, ``v``. ``strategy``: ``"token_ring"``, ``"ring"``, ``"ring_bidir"``,
    ``"ulysses"`` or ``"auto"``. With no process group initialised (or one rank) plain attention runs.
    """
    rank, P = group_info(group)
    _check_local(q, k, v, rank)
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"strategy={strategy!r} is unknown; choose one of {STRATEGY_NAMES}")
    layout = layout if layout is not None else ("zigzag" if causal else "contiguous")
    check_layout(layout)
    B, s, H, d = q.shape
    Hkv = k.shape[2]
    scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    if P == 1:
        return _single_device(q, k, v, causal, scale)
    if layout == "zigzag" and s % 2:
        raise ValueError(f"rank {rank}: layout='zigzag' needs an even local length (two chunks per rank), got "
                         f"{s}; pad the global sequence to a multiple of 2*P = {2 * P}")
    name = strategy
    if name == "ulysses" and H % P:
        raise ValueError(f"strategy='ulysses' needs the {H} query heads to divide over {P} ranks (H % P == 0); "
                         f"use strategy='token_ring' or 'ring', or a group size that divides {H}")
    if name == "ring_bidir" and Hkv % 2:
        raise ValueError(f"strategy='ring_bidir' sends half of the K/V heads each way and needs an even number "
                         f"of key/value heads, got {Hkv}; use strategy='ring' (or 'token_ring')")
    if strategy == "auto":  # the cost model; a pure function of shapes and topology, identical on every rank
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        name = choose_strategy(H, Hkv, P, B=B, s=s, d=d, dtype=q.dtype, causal=causal, layout=layout,
                               backward=grad, device_type=q.device.type)
    describe = f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}, causal={causal}, layout={layout}"
    _check_across_ranks(_signature(q, k, causal, layout, strategy, scale, name), describe, group,
                        q.device if dist.get_backend(group) == "nccl" else "cpu", rank, P)
    cfg = Config(group=group, rank=rank, P=P, causal=causal, layout=layout, scale=scale, **(_config or {}))
    if name == "ulysses":
        rep = ulysses_kv_heads(H, Hkv, P) // Hkv
        if rep > 1:  # replicate K/V heads so they split evenly over P (autograd sums their gradients back)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return ScheduledAttention.apply(q, k, v, STRATEGIES[name], cfg)
