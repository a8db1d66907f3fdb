"""Data x sequence parallelism: tokenring over the ``cp`` ranks of a device mesh, data parallelism over ``dp``.

The gradient is reduced the way the field does it (PyTorch's context parallelism in TorchTitan, accelerate):
DDP or FSDP over *all* ``dp * cp`` ranks (the flattened mesh), which average their gradients, with each rank's
loss scaled so that the average is the gradient of the global mean. A rank's loss is
``W * (its tokens' loss sum) / N`` (``W = dp * cp`` ranks, ``N`` the targets of the global batch): DDP's
average ``(1/W) sum_r`` of those is exactly ``sum_all / N``. DDP/FSDP do the reduction; nothing here
hand-writes it.

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    sp = tokenring.training.SequenceParallel(mesh)      # tokenring.hf layers now run over mesh["cp"]
    model = DDP(model, process_group=sp.world)          # or fully_shard(model, mesh=sp.flat_mesh)
    batch = sp.shard_batch(input_ids, labels=input_ids) # this dp rank's samples, the same on its cp ranks
    model(**batch).loss.backward(); optimizer.step()
    sp.reduce_loss(loss)                                # the global mean, for logging

A DDP built over the ``dp`` ranks only (``DDP(model, process_group=sp.dp)``, the natural reading of "DDP over dp,
tokenring over cp") is given a communication hook that averages over every rank instead, so it trains the same.
FSDP2 sharded over other ranks than ``sp.flat_mesh``'s is refused.

Misuse is refused on every rank rather than trained on: a model in DDP over ranks that share a sequence
without this loss scaling (``accelerate``'s ``prepare`` / ``Trainer`` with plain
:func:`tokenring.hf.shard_batch`: gradients 1/cp of the true ones), :func:`tokenring.hf.all_reduce_grads` on
a DDP/FSDP model (twice reduced) or over ranks beyond the tokenring group (``dp`` times the true gradient),
and ranks of one ``cp`` group holding different samples (a per-rank data sampler: checked per batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import collective_device
from .layouts import group_info

__all__ = ["SequenceParallel", "active", "check_ddp"]

_active: "SequenceParallel | None" = None


def active() -> "SequenceParallel | None":
    """The :class:`SequenceParallel` the tokenring.hf layers run under, if any."""
    return _active


class SequenceParallel:
    """Tokenring over ``mesh[cp_dim]``, data parallel over ``mesh[dp_dim]`` (see the module doc).

    ``mesh``: a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` with those dims (a 1-D one, or
    ``None`` for the default group, is all ``cp``: ``dp = 1``). ``verify``: compare a checksum of each
    batch's full inputs across the ``cp`` group (one 16-byte all-gather per batch). Configures
    :mod:`tokenring.hf` (group, layout) for the model's attention layers."""

    def __init__(
        self, mesh=None, *, dp_dim: str = "dp", cp_dim: str = "cp", layout: str = "zigzag", verify: bool = True
    ):
        global _active
        if mesh is None or mesh.ndim == 1:
            self.cp = mesh.get_group() if mesh is not None else dist.group.WORLD
            self.dp = None
            self.flat_mesh = mesh
        else:
            names = mesh.mesh_dim_names or ()
            if dp_dim not in names or cp_dim not in names or mesh.ndim != 2:
                raise ValueError(
                    f"SequenceParallel needs a 2-D mesh with dims ({dp_dim!r}, {cp_dim!r}), got "
                    f"{mesh.ndim}-D dims {names}"
                )
            self.cp = mesh[cp_dim].get_group()
            self.dp = mesh[dp_dim].get_group()
            self.flat_mesh = mesh[(dp_dim, cp_dim)]._flatten(f"{dp_dim}_{cp_dim}")
        self.world = self.flat_mesh.get_group() if self.flat_mesh is not None else dist.group.WORLD
        self.cp_size = group_info(self.cp)[1]  # 1 without a process group: one process, nothing to split
        self.dp_size = dist.get_world_size(self.dp) if self.dp is not None else 1
        self.world_size = self.cp_size * self.dp_size
        self.dp_rank = dist.get_rank(self.dp) if self.dp is not None else 0
        self.layout, self.verify = layout, verify
        self.world_ranks = tuple(dist.get_process_group_ranks(self.world)) if self.world_size > 1 else (0,)
        from . import hf

        hf.configure(group=self.cp, layout=layout)
        _active = self

    def close(self) -> None:
        """Stop being the active configuration (the hf layers fall back to plain :func:`tokenring.hf.configure`)."""
        global _active
        if _active is self:
            _active = None

    def count(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """The global batch's targets (shifted on the full sequences), from this dp rank's full labels."""
        n = (labels[..., 1:] != ignore_index).sum().to(torch.float64)
        if self.dp is not None and self.dp_size > 1:
            n = n.to(collective_device(self.dp))
            dist.all_reduce(n, group=self.dp)
        return n.cpu()

    def check_same_batch(self, *tensors: torch.Tensor) -> None:
        """ValueError on every rank of the cp group unless all of them hold these very tensors (checksums)."""
        same_batch(self.cp, list(tensors))

    def shard_batch(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        ignore_index: int = -100,
        num_items_in_batch=None,
    ) -> dict:
        """This rank's shard of this dp rank's full ``(B, S)`` batch (:func:`tokenring.hf.shard_batch`), with
        ``num_items_in_batch`` = ``N / W`` so that the model's loss is this rank's part of the global mean
        scaled for DDP/FSDP's average over the ``W`` ranks. ``num_items_in_batch``: the global target count
        if already known (a Trainer counts over its accumulated batch), else counted here."""
        from . import hf

        if self.verify:
            self.check_same_batch(*(t for t in (input_ids, labels, position_ids) if t is not None))
        out = hf.shard_batch(
            input_ids,
            labels=labels,
            position_ids=position_ids,
            attention_mask=attention_mask,
            layout=self.layout,
            group=self.cp,
            ignore_index=ignore_index,
            _scaled=True,
        )
        if labels is not None:
            n = self.count(labels, ignore_index) if num_items_in_batch is None else num_items_in_batch
            out["num_items_in_batch"] = torch.as_tensor(n, dtype=torch.float64).to(input_ids.device) / self.world_size
        return out

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global mean loss (every rank) from each rank's scaled loss: their average over all ranks."""
        total = loss.detach().float().to(collective_device(self.world)).clone()
        if self.world_size > 1:
            dist.all_reduce(total, group=self.world)
        return total.to(loss.device) / self.world_size


def same_batch(group, tensors: list) -> None:
    """ValueError on every rank of ``group`` unless all hold the same ``tensors`` (a checksum each, gathered)."""
    P = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if P == 1:
        return
    dev = collective_device(group)
    mine = torch.tensor([_checksum(t) for t in tensors] + [len(tensors)], dtype=torch.int64)
    every = [torch.empty_like(mine, device=dev) for _ in range(P)]
    dist.all_gather(every, mine.to(dev), group=group)
    if any(not torch.equal(e.cpu(), every[0].cpu()) for e in every):
        differ = [r for r, e in enumerate(every) if not torch.equal(e.cpu(), every[0].cpu())]
        raise ValueError(
            f"tokenring: the ranks of one sequence-parallel group hold different samples (ranks "
            f"{differ} differ from rank 0); they must all get the same full sequences, which each "
            f"shards. The data loader is the likely cause: it must be sharded over the data-parallel "
            f"ranks only (a DistributedSampler over dp, or tokenring.hf.SequenceParallelTrainer), "
            f"not over every rank"
        )


def _checksum(t: torch.Tensor) -> int:
    """A cheap content checksum (position-weighted, so a permutation differs too)."""
    x = t.detach().reshape(-1).to(torch.int64)
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) % 1000003
    return int(((x % 1000003) * w).sum().item() * 31 + x.numel())


def _world_average(sp: "SequenceParallel"):
    """A DDP communication hook averaging each gradient bucket over every dp x cp rank of ``sp`` (what DDP over
    the flattened mesh does), for a DDP built over the dp ranks only."""

    def hook(state, bucket):
        grads = bucket.buffer().div_(sp.world_size)
        return dist.all_reduce(grads, group=sp.world, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook


def _check_fsdp(model, cp_ranks: set) -> None:
    """Refuse FSDP2 sharding that would average the loss shares of one sequence wrongly: over ranks sharing the
    sequence with plain (unscaled) shares, or, under :class:`SequenceParallel`, over other ranks than its own."""
    p = next((q for q in model.parameters() if hasattr(q, "device_mesh")), None) if model is not None else None
    if p is None or len(cp_ranks) <= 1:
        return
    mesh_ranks = set(p.device_mesh.mesh.flatten().tolist())
    sp = _active
    if sp is None and len(mesh_ranks & cp_ranks) > 1:
        raise ValueError(
            f"tokenring: the model is sharded by FSDP over ranks {sorted(mesh_ranks)}, which include ranks that "
            f"share one sequence ({sorted(cp_ranks)}). FSDP averages their gradients, so with the plain per-rank "
            f"loss shares the gradient would be 1/{len(mesh_ranks & cp_ranks)} of the true one. Use "
            f"tokenring.training.SequenceParallel(mesh) and its shard_batch, or shard over dp only and "
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
    sp = _active
    if len(cp_ranks & set(ddp_ranks)) <= 1:
        if len(cp_ranks) <= 1 or getattr(ddp, "_tokenring_world_average", False):
            return
        if sp is None or not set(ddp_ranks) <= set(sp.world_ranks):
            raise ValueError(
                f"tokenring: the model runs in DDP over ranks {list(ddp_ranks)}, none of which share this rank's "
                f"sequence (tokenring group {sorted(cp_ranks)}): the gradient shares of one sequence would never "
                f"be summed, and the ranks of a sequence would drift apart. Use tokenring.training."
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
            f"tokenring.training.SequenceParallel(mesh) and its shard_batch (the loss is scaled for DDP over all "
            f"dp x cp ranks), or tokenring.hf.SequenceParallelTrainer with a transformers Trainer"
        )
