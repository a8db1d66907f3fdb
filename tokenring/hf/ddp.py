"""Gradient reduction across the ranks that share a sequence: the checks that DDP / FSDP reduce over
the right ranks (DDP over ``dp`` only gets a hook averaging over every rank), and :func:`all_reduce_grads`
for a model in neither.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layouts import group_info
from .config import _settings, active

__all__ = ["check_ddp", "all_reduce_grads"]


def _world_average(sp):
    """A DDP communication hook averaging each gradient bucket over every dp x cp rank of ``sp`` (what DDP over
    the flattened mesh does), for a DDP built over the dp ranks only."""

    def hook(state, bucket):
        grads = bucket.buffer().div_(sp.world_size)
        return dist.all_reduce(grads, group=sp.world, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook


def _check_fsdp(model, cp_ranks: set) -> None:
    """Refuse FSDP2 sharding that would average the loss shares of one sequence wrongly: over ranks sharing the
    sequence with plain (unscaled) shares, or, under :class:`SequenceParallel`, over other ranks than its own."""
    if model is None or len(cp_ranks) <= 1:
        return
    p = next((q for q in model.parameters() if hasattr(q, "device_mesh")), None)
    if p is None:
        return
    mesh_ranks = set(p.device_mesh.mesh.flatten().tolist())
    sp = active()
    if sp is None and len(mesh_ranks & cp_ranks) > 1:
        raise ValueError(
            f"tokenring: the model is sharded by FSDP over ranks {sorted(mesh_ranks)}, which include ranks that "
            f"share one sequence ({sorted(cp_ranks)}). FSDP averages their gradients, so with the plain per-rank "
            f"loss shares the gradient would be 1/{len(mesh_ranks & cp_ranks)} of the true one. Use "
            f"tokenring.hf.SequenceParallel(mesh) and its shard_batch, or shard over dp only and "
            f"tokenring.hf.all_reduce_grads over cp"
        )
    if sp is not None and mesh_ranks != set(sp.world_ranks):
        raise ValueError(
            f"tokenring: SequenceParallel scales each rank's loss for an average over all {sp.world_size} dp x cp "
            f"ranks {sorted(sp.world_ranks)}, but FSDP shards the model over ranks {sorted(mesh_ranks)}: the "
            f"shares of one sequence would not be summed. Use fully_shard(model, mesh=sp.flat_mesh)"
        )


def check_ddp(group, model=None) -> None:
    """Called by the tokenring.hf layers (``model``: the model whose forward is running, if known): refuse a DDP
    forward whose ranks include this tokenring group's when the loss was not scaled for it (its average over
    the group's ranks would give 1/cp of the gradient), or that averages over other ranks than the active
    :class:`SequenceParallel`'s; a DDP over the dp ranks only under a SequenceParallel is made to average over
    every rank (a communication hook), the natural reading of "DDP over dp, tokenring over cp". FSDP2 sharding
    is checked the same way (:func:`_check_fsdp`)."""
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        return
    cp_ranks = set(dist.get_process_group_ranks(group)) if dist.get_world_size(group) > 1 else set()
    _check_fsdp(model, cp_ranks)
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return
    ddp_ranks = tuple(dist.get_process_group_ranks(ddp.process_group))
    sp = active()
    if len(cp_ranks & set(ddp_ranks)) <= 1:
        if len(cp_ranks) <= 1 or getattr(ddp, "_tokenring_world_average", False):
            return
        if sp is None or not set(ddp_ranks) <= set(sp.world_ranks):
            raise ValueError(
                f"tokenring: the model runs in DDP over ranks {list(ddp_ranks)}, none of which share this rank's "
                f"sequence (tokenring group {sorted(cp_ranks)}): the gradient shares of one sequence would never "
                f"be summed, and the ranks of a sequence would drift apart. Use tokenring.hf."
                f"SequenceParallel(mesh) (DDP over its dp ranks is then made to average over every rank)"
            )
        try:  # DDP over dp only: average over every dp x cp rank instead, as SequenceParallel's scaling expects
            ddp.register_comm_hook(None, _world_average(sp))
        except Exception as e:
            raise ValueError(
                f"tokenring: the model runs in DDP over the dp ranks {list(ddp_ranks)} only, whose average leaves "
                f"the cp shares of a sequence unsummed; tokenring could not install its averaging over every rank "
                f"({e}). Build DDP with process_group=sp.world"
            ) from None
        ddp._tokenring_world_average = True
        return
    if sp is None or tuple(sorted(sp.world_ranks)) != tuple(sorted(ddp_ranks)):
        raise ValueError(
            f"tokenring: the model runs in DDP over ranks {list(ddp_ranks)}, which include ranks that share one "
            f"sequence (tokenring group {sorted(cp_ranks)}). DDP averages their gradients, so with the plain "
            f"per-rank loss shares the gradient would be 1/{len(cp_ranks & set(ddp_ranks))} of the true one. Use "
            f"tokenring.hf.SequenceParallel(mesh) and its shard_batch (the loss is scaled for DDP over all "
            f"dp x cp ranks), or tokenring.hf.SequenceParallelTrainer with a transformers Trainer"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 shards parameters and gradients over its mesh), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def _ranks(group) -> set:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _check_reduction(model, group) -> None:
    """Refuse a sum over ``group`` that would count a gradient twice or sum over data-parallel ranks."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "tokenring.hf.all_reduce_grads: the model is in DDP, which already reduces its "
            "gradients; use tokenring.hf.SequenceParallel (its loss is scaled for DDP over "
            "all ranks) instead of also summing here"
        )
    mine = _ranks(group)
    tokenring_group = _ranks(_settings.group)
    if not mine <= tokenring_group:
        raise ValueError(
            f"tokenring.hf.all_reduce_grads sums gradients over the ranks that share a sequence (the "
            f"tokenring group {sorted(tokenring_group)}), but group= has ranks {sorted(mine)}: with "
            f"data parallelism that sums the data-parallel ranks' gradients too (dp times the true "
            f"gradient). Sum over the cp group only and let DDP/FSDP average over dp, or use "
            f"tokenring.hf.SequenceParallel"
        )
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "device_mesh"):
            shared = set()
            for dim in range(g.device_mesh.ndim):
                shared |= _ranks(g.device_mesh.get_group(dim)) & mine
            if len(shared) > 1:
                raise ValueError(
                    "tokenring.hf.all_reduce_grads: FSDP already reduces these gradients over ranks "
                    f"{sorted(shared)} of the tokenring group; shard the model over dp only "
                    "(fully_shard(model, mesh=mesh['dp'])), or use FSDP over all ranks with "
                    "tokenring.hf.SequenceParallel and no all_reduce_grads"
                )
            break


def all_reduce_grads(model: torch.nn.Module, group=None, bucket_bytes: int = 32 << 20) -> None:
    """Sum every parameter's ``.grad`` over the ranks (in place), after ``loss.backward()`` on each rank's
    loss share: the result equals the single-process gradient of the global mean loss. Gradients are
    flattened into buckets of about ``bucket_bytes`` per collective; parameters without a gradient on this
    rank get zeros first (every rank must join the same collectives)."""
    group = group if group is not None else _settings.group
    if group_info(group)[1] == 1:
        return
    _check_reduction(model, group)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets, cur, size = [], [], 0
    for p in params:
        g = _local(p.grad)
        key = (g.dtype, g.device)
        if cur and (size + g.numel() * g.element_size() > bucket_bytes or key != cur[0][0]):
            buckets.append(cur)
            cur, size = [], 0
        cur.append((key, p))
        size += g.numel() * g.element_size()
    if cur:
        buckets.append(cur)
    for bucket in buckets:
        grads = [_local(p.grad) for _, p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
