"""Check tokenring's CUDA path on a machine without a GPU.

    with tokenring.testing.pretend_cuda("NVIDIA H100 80GB HBM3", (9, 0)), tokenring.testing.fake_rank(1, 4):
        q = torch.empty(1, 4096, 32, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
        tokenring.attention(q, k, v, causal=True).sum().backward()   # rank 1 of 4: CUDA ops, NCCL semantics

Inside :func:`pretend_cuda`, tokenring treats meta tensors as CUDA tensors of the named GPU (kernel choice,
topology detection, merge, message staging, timing events all take their CUDA branch). :func:`fake_rank` makes
this process rank r of P over PyTorch's fake process group, whose point-to-point operations and collectives
accept meta tensors and complete at once. Shapes, dtypes, strides, devices and op schemas are real, values are
not. Any host read of a value (``.item()``, ``.tolist()``, ``.cpu()``) or a CPU tensor mixed into the work fails
loudly on meta tensors, which is what such a test is for.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .agreement import forget_groups
from .device import GPU, _set_pretend

__all__ = ["pretend_cuda", "fake_rank", "GPU"]


@contextlib.contextmanager
def pretend_cuda(
    name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0), per_node: int = 8, link: str = "nvlink"
):
    """Within this block meta tensors are CUDA tensors on ``per_node`` GPUs called ``name`` of compute
    ``capability``, linked by ``link`` (``"nvlink"`` or ``"pcie"``)."""
    old = _set_pretend(GPU(name, tuple(capability), int(per_node), link))
    try:
        yield
    finally:
        _set_pretend(old)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """Within this block this process is rank ``rank`` of ``world_size`` in a default process group over
    PyTorch's fake backend (for CPU, CUDA and meta tensors). Needs no default group to exist already."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("tokenring.testing.fake_rank: a default process group exists already; destroy it first")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    dist.init_process_group(backend="cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_groups()


def meta_like(*shape, dtype=torch.bfloat16, requires_grad: bool = False) -> torch.Tensor:
    """An empty meta tensor (a pretended CUDA tensor) of ``shape``."""
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)
