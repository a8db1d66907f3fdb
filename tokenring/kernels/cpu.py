"""PyTorch's CPU flash ops: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (tiled,
GQA-aware, any additive mask). The backward runs fused for the dtypes this CPU runs it fast in
(:func:`cpu_backward_choice`); else the math path takes it.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch

from .. import settings
from ..merge import acc_dtype
from .base import Backend, additive
from .reference import math_backward

__all__ = ["CpuFlash", "cpu_backward_choice"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class CpuFlash(Backend):
    name = "cpu_flash"

    def supports(self, q, mask, backward) -> bool:
        if q.device.type != "cpu" or q.dtype not in _DTYPES:
            return False
        return not backward or cpu_backward_choice(q.dtype, q.shape[-1]) == self.name

    def describe(self) -> str:
        return "cpu_flash: CPU, float64/32, bf16/fp16 (backward fused where this CPU runs the dtype fast), masks"

    def forward(self, q, k, v, causal, scale, mask=None):
        # The op takes (B, H, S, d); transposed views are accepted and it handles GQA itself.
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=additive(mask, q),
            scale=scale,
        )  # fmt: skip
        # lse: (B, H, n) as a view of the op's (B, n, H) layout (a merge reads any strides; those that keep it
        # make it contiguous)
        o, acc = o.transpose(1, 2), acc_dtype(q.dtype)
        if lse.dtype != acc:
            lse = lse.to(acc)
        if mask is not None:  # the op leaves lse 0 on rows that see no key; the merge needs -inf there
            lse.masked_fill_(~mask.any(1), float("-inf"))
        return o, lse

    def backward(self, dout, q, k, v, out, lse, delta, causal, scale, mask=None):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.to(acc_dtype(q.dtype)).contiguous(), 0.0, causal, attn_mask=additive(mask, q), scale=scale,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# The fused CPU backward beats the math path in float32 and float64; in bf16 / fp16 only on CPUs with native
# instructions for the type (bench/results/archive/fused_backward.md), so the choice follows the CPU's flags, with a
# timing as the fallback where flags are unknown.
_CPU_FUSED_ALWAYS = (torch.float32, torch.float64)
_FAST_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_MATH_MARGIN = 1.5  # when timing: the math path only when the fused kernel is this much slower


def _cpu_flags() -> set[str]:
    """The x86 feature flags of this CPU (Linux), or an empty set where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_backward_choice(dtype: torch.dtype, d: int) -> str:
    """``"cpu_flash"`` or ``"math"``: the CPU backward for ``dtype`` and head dim ``d`` on this machine.

    float32/float64: the fused kernel. bf16/fp16: the fused kernel where the CPU has native instructions for
    the type (AVX512-BF16 / AMX-BF16, AVX512-FP16 / AMX-FP16), else the math path; the same answer on every
    rank and every run. Where the flags cannot be read (non-x86, non-Linux) both kernels run once per process
    on one 256x256 block of 4 heads and the math path is taken only when the fused one is more than 1.5x
    slower. The ``cpu_backward`` setting (:mod:`tokenring.settings`, ``$TOKENRING_CPU_BACKWARD``) overrides."""
    return settings.get("cpu_backward") or _cpu_backward_measured(dtype, d)


@lru_cache(maxsize=64)
def _cpu_backward_measured(dtype: torch.dtype, d: int) -> str:
    """:func:`cpu_backward_choice` without the setting: from the CPU's flags, else timed once per process."""
    if dtype in _CPU_FUSED_ALWAYS:
        return "cpu_flash"
    flags = _cpu_flags()
    if flags and dtype in _FAST_FLAGS:
        return "cpu_flash" if flags.intersection(_FAST_FLAGS[dtype]) else "math"
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 256, 4, d, generator=g).to(dtype) for _ in range(4))
    o, lse = CpuFlash().forward(q, k, v, False, d**-0.5)
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).transpose(1, 2).contiguous()
    best = {}
    for which in ("cpu_flash", "math"):
        times = []
        for _ in range(3):  # the first run warms up
            t0 = time.perf_counter()
            if which == "math":
                math_backward(do, q, k, v, lse, delta, False, d**-0.5)
            else:
                CpuFlash().backward(do, q, k, v, o, lse, delta, False, d**-0.5)
            times.append(time.perf_counter() - t0)
        best[which] = min(times[1:])
    return "math" if best["cpu_flash"] > _MATH_MARGIN * best["math"] else "cpu_flash"


cpu_backward_choice.cache_clear = _cpu_backward_measured.cache_clear
