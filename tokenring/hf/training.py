"""Data x sequence parallelism: tokenring over the ``cp`` ranks of a device mesh, data parallelism over ``dp``,
with each rank's loss scaled so that DDP/FSDP's average is the global mean's gradient (docs/hf.md).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..comm import guard_exit
from ..device import collective_device
from ..layouts import group_info
from .batch import shard_batch
from .config import _settings, active, configure, restore, same_batch, set_active

__all__ = ["SequenceParallel"]


class SequenceParallel:
    """Tokenring over ``mesh[cp_dim]``, data parallel over ``mesh[dp_dim]``; configures :mod:`tokenring.hf` for
    the model's attention layers (docs/hf.md)."""

    def __init__(
        self, mesh=None, *, dp_dim: str = "dp", cp_dim: str = "cp", layout: str = "zigzag", verify: bool = True
    ):
        if mesh is None and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group()  # torchrun's environment, as init_device_mesh would (gloo on CPU, NCCL on GPU)
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
        guard_exit(self.world)
        self.cp_size = group_info(self.cp)[1]  # 1 without a process group: one process, nothing to split
        self.dp_size = dist.get_world_size(self.dp) if self.dp is not None else 1
        self.world_size = self.cp_size * self.dp_size
        self.dp_rank = dist.get_rank(self.dp) if self.dp is not None else 0
        self.layout, self.verify = layout, verify
        self.world_ranks = tuple(dist.get_process_group_ranks(self.world)) if self.world_size > 1 else (0,)
        self._before = (_settings.group, _settings.layout)  # what close() puts back
        configure(group=self.cp, layout=layout)
        set_active(self)

    def close(self) -> None:
        """Stop being the active configuration: the hf layers' group and layout go back to what they were before
        (a later model over all ranks must not run its attention over this mesh's cp ranks only)."""
        if active() is self:
            set_active(None)
            restore(*self._before)

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
        """This rank's shard of this dp rank's full ``(B, S)`` batch, its loss scaled for DDP/FSDP's average."""
        if self.verify:
            self.check_same_batch(*(t for t in (input_ids, labels, position_ids) if t is not None))
        out = shard_batch(
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
