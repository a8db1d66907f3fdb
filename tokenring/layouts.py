"""Sequence layouts: which global tokens each rank holds, plus ``shard`` / ``gather``.

- ``contiguous``: rank ``r`` holds tokens ``[r*s, (r+1)*s)``.
- ``zigzag``: the sequence is cut into ``2P`` chunks; rank ``r`` holds chunks ``r`` and ``2P-1-r`` (in that
  order), which balances causal work: every rank owns one early and one late chunk.

Within a rank the local tokens are always in increasing global order, so a causal mask on a rank's own
Q against its own K/V is the plain lower-triangular mask.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["LAYOUTS", "default_layout", "check_layout", "local_positions", "global_order", "shard", "gather", "group_info"]

LAYOUTS = ("contiguous", "zigzag")


def default_layout(causal: bool) -> str:
    """``zigzag`` for causal attention (it balances the triangle's work over the ranks), else ``contiguous``."""
    return "zigzag" if causal else "contiguous"


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use one of {LAYOUTS}")


def group_info(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_divisible(S: int, P: int, layout: str, what: str = "sequence length") -> None:
    parts = 2 * P if layout == "zigzag" else P
    if S % parts:
        raise ValueError(
            f"{what} {S} cannot be split for layout={layout!r} over {P} ranks: it must be divisible by {parts}"
            f" ({'2*P chunks' if layout == 'zigzag' else 'P shards'}); pad the sequence to a multiple of {parts}")


def local_positions(S: int, P: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global token positions (int64, length ``S // P``) held by ``rank``, in local order."""
    check_layout(layout)
    _check_divisible(S, P, layout)
    if layout == "contiguous":
        s = S // P
        return torch.arange(rank * s, (rank + 1) * s, device=device)
    c = S // (2 * P)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * P - 1 - rank) * c, (2 * P - rank) * c, device=device)
    return torch.cat([first, second])


def global_order(S: int, P: int, layout: str, device=None) -> torch.Tensor:
    """Positions of the concatenation ``[rank 0's shard, rank 1's shard, ...]``: ``cat(...)[i]`` is token
    ``global_order[i]``. ``argsort`` of it reorders a concatenation back to natural order."""
    return torch.cat([local_positions(S, P, r, layout, device) for r in range(P)])


def shard(x_full: torch.Tensor, dim: int = 1, layout: str = "contiguous", group=None) -> torch.Tensor:
    """This rank's shard of ``x_full`` (identical on every rank) along ``dim``.

    With no process group initialised the whole tensor is returned.
    """
    rank, P = group_info(group)
    dim = dim % x_full.dim()
    idx = local_positions(x_full.shape[dim], P, rank, layout, device=x_full.device)
    if layout == "contiguous":
        return x_full.narrow(dim, int(idx[0]), idx.numel())
    return x_full.index_select(dim, idx)


def gather(x_local: torch.Tensor, dim: int = 1, layout: str = "contiguous", group=None) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor along ``dim``, on every rank (not differentiable)."""
    check_layout(layout)
    rank, P = group_info(group)
    if P == 1:
        return x_local
    dim = dim % x_local.dim()
    parts = [torch.empty_like(x_local) for _ in range(P)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    cat = torch.cat(parts, dim=dim)
    if layout == "contiguous":
        return cat
    order = global_order(cat.shape[dim], P, layout, device=cat.device)
    return cat.index_select(dim, torch.argsort(order))
