"""What tokenring knows about the device it runs on, in one place: the seam that
:func:`tokenring.testing.pretend_cuda` sets (docs/internals.md, "The device seam").
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import time
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

__all__ = [
    "GPU",
    "is_cuda",
    "device_type",
    "gpu",
    "nccl",
    "collective_device",
    "values_travel",
    "autocast_dtype",
    "no_autocast",
    "Event",
    "synchronize",
    "pretended",
]


@dataclass(frozen=True)
class GPU:
    """A node's GPUs: model name, compute capability, GPUs per node, link (``"nvlink"`` or ``"pcie"``)."""

    name: str
    capability: tuple[int, int]
    per_node: int
    link: str

    def __post_init__(self):
        if self.link not in ("nvlink", "pcie"):
            raise ValueError(f"GPU link must be 'nvlink' or 'pcie', got {self.link!r}")

    @property
    def nvidia(self) -> bool:
        """An NVIDIA GPU (cuDNN's ops exist); AMD GPUs run PyTorch's CUDA API through ROCm without them."""
        return not any(x in self.name.upper() for x in ("AMD", "INSTINCT", "RADEON")) and (
            _pretend is not None or torch.version.hip is None
        )


_pretend: GPU | None = None


def pretended() -> GPU | None:
    """The GPU :func:`tokenring.testing.pretend_cuda` pretends, or ``None`` outside it."""
    return _pretend


def _set_pretend(g: GPU | None) -> GPU | None:
    global _pretend
    old, _pretend = _pretend, g
    return old


def _device(x) -> torch.device:
    """``x``'s device: a tensor's (or a placeholder's that has one, :class:`tokenring.program.Ref`), or ``x``."""
    dev = getattr(x, "device", None)
    return dev if isinstance(dev, torch.device) else torch.device(x)


def is_cuda(x) -> bool:
    """Whether ``x`` (a tensor or a device) is on a CUDA GPU (a meta tensor inside ``pretend_cuda``)."""
    dev = _device(x)
    return dev.type == "cuda" or (_pretend is not None and dev.type == "meta")


def device_type(x) -> str:
    """``"cuda"`` for CUDA (and pretended) tensors, else the device's type."""
    return "cuda" if is_cuda(x) else _device(x).type


def _nvlinked(index: int) -> bool | None:
    """Whether GPU ``index`` has an active NVLink (NVML, when ``pynvml`` is installed); ``None``: unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        for link in range(18):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link):
                    return True
            except pynvml.NVMLError:
                break
        return False
    except Exception:
        return None


def pcie_by_name(name: str) -> bool:
    """Whether a GPU of this name is a PCIe card without NVLink between cards."""
    return bool(re.search(r"pcie|\bL4\d*S?\b|\bA10G?\b|\bA40\b|RTX", name, re.IGNORECASE))


def gpu(device=None) -> GPU:
    """This process's GPU (``per_node`` and ``link``: docs/internals.md, "The device seam")."""
    if _pretend is not None:
        return _pretend
    index = None if device is None else _device(device).index
    return _real_gpu(torch.cuda.current_device() if index is None else index)


@lru_cache(maxsize=None)
def _real_gpu(index: int) -> GPU:
    name = torch.cuda.get_device_name(index)
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(env) if env.isdigit() and int(env) > 0 else torch.cuda.device_count()
    linked = _nvlinked(index)
    if linked is None:
        linked = not pcie_by_name(name)
    return GPU(name, torch.cuda.get_device_capability(index), per_node, "nvlink" if linked else "pcie")


def nccl(group, backend: str | None = None) -> bool:
    """Whether ``group`` has NCCL's semantics: an NCCL group, or the fake group inside ``pretend_cuda``
    (``backend``: the group's, where the caller has it)."""
    backend = str(dist.get_backend(group) if backend is None else backend)
    return backend == "nccl" or (_pretend is not None and "fake" in backend)


def values_travel(group) -> bool:
    """False on PyTorch's fake process group, whose collectives complete without moving a value."""
    return "fake" not in str(dist.get_backend(group))


def collective_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device on NCCL, else the CPU."""
    if not nccl(group):
        return torch.device("cpu")
    return torch.device("meta") if _pretend is not None else torch.device("cuda", torch.cuda.current_device())


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts ``t``'s attention inputs to, or ``None`` (off; meta tensors)."""
    kind = t.device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def no_autocast(t: torch.Tensor):
    """A context that turns autocast off for ``t``'s device (nothing to turn off where it is off, or for meta
    tensors)."""
    kind = t.device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return contextlib.nullcontext()
    return torch.autocast(kind, enabled=False)


class _HostEvent:
    """A CUDA event's interface on the host clock (pretended GPUs have no stream to record on)."""

    def __init__(self):
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def Event():
    """A timing event on the current stream (``torch.cuda.Event(enable_timing=True)``)."""
    return _HostEvent() if _pretend is not None else torch.cuda.Event(enable_timing=True)


def synchronize() -> None:
    if _pretend is None:
        torch.cuda.synchronize()


def machine() -> dict:
    """Facts of this host for results files: name, CPU, cores, Python and torch versions."""
    return dict(
        host=platform.node(),
        cpu=_cpu_name(),
        cores=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.cuda.is_available(),
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
