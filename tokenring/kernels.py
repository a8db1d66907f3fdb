"""Local block attention: ``(q_block, kv_block) -> (out, lse)`` and its backward, per backend.

Shapes (flash-attn layout): ``q`` (B, n, H, d); ``k``, ``v`` (B, m, Hkv, d) with ``H % Hkv == 0``.
Forward returns ``out`` (B, n, H, d) in ``q.dtype`` and ``lse`` (B, H, n) in the accumulator dtype (float32,
float64 for float64 inputs). ``causal`` masks key ``j > i`` (top-left aligned); every schedule only uses it on
square diagonal blocks, where every row sees at least one key.

Backends, forward and backward:
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (tiled, GQA-aware). The
  backward is used for the dtypes this CPU runs it fast in (:func:`cpu_backward_choice`).
- CUDA (:func:`cuda_kernel`): PyTorch's cuDNN ops on sm90+ (fp16/bf16, head dim a multiple of 8 up to 128),
  flash ops (fp16/bf16 up to 256; both GQA-native) or memory-efficient ops (fp32, head dim a multiple of 4;
  equal heads: the strategies repeat each visiting K/V block's heads once, see :func:`needs_equal_heads`).
  float64 and other head dims take the math path. Each op's lse layout is normalised in :func:`_lse_from`.
- math: row-chunked matmul + softmax in the accumulator dtype; any device and dtype; memory stays
  O(chunk * m), never (n * m). The reference and the fallback.

The backward takes ``delta = rowsum(dO * O)``, which is what the strategies ship with a visiting query block
(one number per row and head instead of ``O``'s ``d``); fused kernels, which form ``delta`` from ``O``
themselves, get an equivalent ``O'`` (:func:`out_for_delta`) when the real output is not at hand.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache

import torch

from . import settings
from .device import autocast_dtype, gpu, is_cuda
from .merge import acc_dtype

__all__ = [
    "block_forward",
    "block_backward",
    "tiled_forward",
    "tiled_backward",
    "math_forward",
    "math_backward",
    "out_for_delta",
    "cpu_backward_choice",
    "needs_equal_heads",
    "cuda_kernel",
    "BACKENDS",
]

BACKENDS = ("auto", "cpu_flash", "cuda", "math")
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Upper bound on elements of one chunk's score tensor in the math path (16 MiB in float32).
_MATH_CHUNK_ELEMS = 1 << 22


def _pick(q: torch.Tensor, backend: str, mask: torch.Tensor | None = None) -> str:
    if backend == "cuda" and mask is not None:
        return "math"  # no boolean mask in the CUDA fused ops
    if backend != "auto":
        return backend
    if q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES:
        return "cpu_flash"
    if is_cuda(q) and _cuda_op(q) is not None and mask is None:
        return "cuda"
    return "math"


def softmax_scale_of(softmax_scale: float | None, d: int) -> float:
    """The scale the caller asked for (default ``d ** -0.5``); ValueError unless it is a finite number."""
    scale = float(softmax_scale) if softmax_scale is not None else d**-0.5
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return scale


def value_dim_apart(q, k, v, softmax_scale: float | None):
    """MLA (DeepSeek-V3, Kimi K2): a value head dim ``dv`` other than q/k's ``d``. Zero columns make the dims
    equal without changing a number: padding ``v`` (``dv < d``) adds output columns that are exactly 0, padding
    ``q`` and ``k`` (``dv > d``) adds 0 to every score. Returns ``(q, k, v, scale, dv)``, with the scale fixed
    at q/k's own ``d`` and ``dv`` the columns to keep (``None``: nothing was padded). Tensors whose other dims
    disagree pass through to the shape checks."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return q, k, v, softmax_scale, None
    d, dv = q.shape[-1], v.shape[-1]
    if dv == d or k.shape[-1] != d or k.shape[:3] != v.shape[:3]:
        return q, k, v, softmax_scale, None
    scale = softmax_scale if softmax_scale is not None else d**-0.5  # checked (on every rank) by the caller
    if dv < d:
        return q, k, torch.nn.functional.pad(v, (0, d - dv)), scale, dv
    pad = (0, dv - d)
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), v, scale, dv


def attention_inputs(q, k, v, softmax_scale: float | None):
    """What every entry point does first: under ``torch.autocast`` cast q, k, v to its dtype as
    ``scaled_dot_product_attention`` does (rotary embeddings leave q and k in float32 beside a bf16 v), then
    :func:`value_dim_apart`. Returns ``(q, k, v, scale, dv)``."""
    dt = autocast_dtype(q) if isinstance(q, torch.Tensor) else None
    if dt is not None:
        q, k, v = (t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    return value_dim_apart(q, k, v, softmax_scale)


def fold_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """A scale <= 0 folded into the queries (differentiably): the fused kernels mask causal blocks in a way that
    gives NaN at such scales (PyTorch's CPU flash op and SDPA alike), while ``(q * scale) k^T`` at scale 1 is
    the same attention. Positive scales pass untouched (no extra rounding)."""
    return (q * scale, 1.0) if scale <= 0 else (q, scale)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str = "auto",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one Q block over one K/V block. Returns ``(out (B,n,H,d) q.dtype, lse (B,H,n) acc)``.
    ``mask``: optional (n, m) bool, True where a query sees a key (rows that see none get out 0, lse -inf);
    it runs on the CPU kernel or the math path (the CUDA fused ops take no boolean mask)."""
    which = _pick(q, backend, mask)
    if which == "cpu_flash":
        # The op takes (B, H, S, d); transposed views are accepted and it handles GQA itself.
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            0.0,
            causal,
            attn_mask=_additive(mask, q),
            scale=scale,
        )
        o, lse = o.transpose(1, 2), lse.to(acc_dtype(q.dtype)).contiguous()
        if mask is not None:  # the op leaves lse 0 on rows that see no key; the merge needs -inf there
            lse.masked_fill_(~mask.any(1), float("-inf"))
        return o, lse
    if which == "cuda":
        return _cuda_forward(q, k, v, causal, scale)
    if which == "math":
        return math_forward(q, k, v, causal, scale, mask)
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")


def _additive(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask as the additive float mask the CPU op takes (0 where visible, -inf elsewhere)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))


def tiled_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles, mask_of, scale: float, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of a block cut into :class:`tokenring.masks.Tile` s (disjoint query rows): each tile's rows come
    from one kernel call; rows in no tile see no key (out 0, lse -inf). ``mask_of(tile)``: its bool mask."""
    B, n, H, d = q.shape
    o = torch.zeros(B, n, H, d, dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for t in tiles:
        ot, lt = block_forward(
            q[:, t.q0 : t.q1], k[:, t.k0 : t.k1], v[:, t.k0 : t.k1], t.kind == "causal", scale, backend, mask_of(t)
        )
        o[:, t.q0 : t.q1] = ot
        lse[:, :, t.q0 : t.q1] = lt
    return o, lse


def tiled_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    tiles,
    mask_of,
    scale: float,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` of a block cut into tiles (see :func:`tiled_forward`), in the accumulator dtype:
    dQ rows come from one tile each, dK/dV rows sum over the tiles that read them."""
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for t in tiles:
        rows, keys = slice(t.q0, t.q1), slice(t.k0, t.k1)
        g = block_backward(
            dout[:, rows],
            q[:, rows],
            k[:, keys],
            v[:, keys],
            lse[:, :, rows],
            delta[:, :, rows],
            t.kind == "causal",
            scale,
            backend,
            None if out is None else out[:, rows],
            mask_of(t),
        )
        dq[:, rows] += g[0]
        dk[:, keys] += g[1]
        dv[:, keys] += g[2]
    return dq, dk, dv


def _cuda_forward(q, k, v, causal, scale):
    n, H = q.shape[1], q.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    op = _cuda_op(q)
    if op == "cudnn":  # GQA-native
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
    elif op == "flash":  # GQA-native
        res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    else:  # equal heads only (callers repeat a visiting block's K/V heads once, see needs_equal_heads)
        kt, vt = _repeat_heads(kt, H), _repeat_heads(vt, H)
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, causal, scale=scale)
    return res[0].transpose(1, 2), _lse_from(op, res[1], n, acc_dtype(q.dtype))


def _lse_from(op: str, lse: torch.Tensor, n: int, acc: torch.dtype) -> torch.Tensor:
    """The one place each CUDA op's log-sum-exp becomes ours, (B, H, n) natural-log in ``acc``: flash gives
    (B, H, n); cuDNN (B, H, n, 1); the efficient op (B, H, ceil(n / 32) * 32), rows padded."""
    if op == "cudnn":
        lse = lse.squeeze(-1)
    elif op == "efficient":
        lse = lse[..., :n]
    return lse.to(acc).contiguous()


def _lse_for(op: str, lse: torch.Tensor) -> torch.Tensor:
    """Our (B, H, n) log-sum-exp in the layout op ``op``'s backward reads (the inverse of :func:`_lse_from`)."""
    if op == "cudnn":
        return lse.unsqueeze(-1)
    if op == "efficient":
        pad = -lse.shape[-1] % 32
        return torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    return lse


def _grouped(q: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B, n, H, d) -> (B, Hkv, g, n, d): query heads grouped under the K/V head they share."""
    B, n, H, d = q.shape
    return q.view(B, n, Hkv, H // Hkv, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, g, n, d) -> (B, n, H, d)."""
    B, Hkv, g, n, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, n, Hkv * g, d)


def _chunk_rows(q: torch.Tensor, m: int) -> int:
    B, _, H, _ = q.shape
    return max(1, _MATH_CHUNK_ELEMS // max(1, B * H * m))


def _scores(qc, kt, scale, causal, row0, mask=None):
    """Scaled scores (B, Hkv, g, c, m) of grouped query rows ``row0 + [0, c)`` against ``kt`` (B, Hkv, 1, d, m);
    ``mask`` (n, m) bool hides the pairs where it is False."""
    s = torch.matmul(qc, kt) * scale
    if mask is not None:
        s = s.masked_fill(~mask[row0 : row0 + s.shape[-2]], float("-inf"))
    if causal:
        c, m = s.shape[-2], s.shape[-1]
        rows = torch.arange(row0, row0 + c, device=s.device).unsqueeze(1)
        s = s.masked_fill(torch.arange(m, device=s.device) > rows, float("-inf"))
    return s


def math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-quality forward in the accumulator dtype, chunked over query rows (memory O(chunk * m))."""
    acc = acc_dtype(q.dtype)
    B, n, H, d = q.shape
    m, Hkv = k.shape[1], k.shape[2]
    qg = _grouped(q, Hkv).to(acc)
    kt = k.transpose(1, 2).unsqueeze(2).to(acc).transpose(-1, -2)  # (B, Hkv, 1, d, m)
    vg = v.transpose(1, 2).unsqueeze(2).to(acc)  # (B, Hkv, 1, m, d)
    out = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)  # (B, Hkv, g, n)
    step = _chunk_rows(q, m)
    for r0 in range(0, n, step):
        s = _scores(qg[..., r0 : r0 + step, :], kt, scale, causal, r0, mask)
        l = torch.logsumexp(s, dim=-1)
        # Rows with no key: lse = -inf, out = 0 (exp(s - 0) of all -inf is 0, never NaN).
        p = torch.exp(s - torch.where(torch.isneginf(l), torch.zeros_like(l), l).unsqueeze(-1))
        out[..., r0 : r0 + step, :] = torch.matmul(p, vg)
        lse[..., r0 : r0 + step] = l
    return _ungrouped(out).to(q.dtype), lse.reshape(B, H, n)


def out_for_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """An output ``O'`` (B, n, H, d) in ``dout.dtype`` with ``rowsum(dO * O') == delta`` (delta (B, H, n)).

    A fused backward kernel wants the rows' output ``O`` only to form ``delta = rowsum(dO * O)`` itself. A
    visiting query block travels with ``delta`` (one number per row and head) instead of ``O`` (``d`` numbers),
    so the kernel gets the multiple of ``dO`` that has exactly that row sum: ``O' = dO * delta / |dO|^2``,
    computed on ``dO`` scaled by its row maximum so that no square under- or overflows. Rows with ``dO = 0``
    get ``O' = 0`` (their gradient is 0 whatever ``delta`` is)."""
    acc = acc_dtype(dout.dtype)
    g = dout.to(acc)
    top = g.abs().amax(-1, keepdim=True)  # (B, n, H, 1)
    live = top > 0
    u = g / torch.where(live, top, torch.ones_like(top))  # entries in [-1, 1], max |u| = 1
    norm = (u * u).sum(-1, keepdim=True).clamp_min(1.0)  # >= 1 on live rows
    c = delta.to(acc).transpose(1, 2).unsqueeze(-1) / (top * norm).where(live, torch.ones_like(top))
    return (u * c.where(live, torch.zeros_like(c))).to(dout.dtype)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the rows' *global* ``lse`` and ``delta = rowsum(dO * O)`` (both (B, H, n)).

    Returns ``dq`` (B, n, H, d) and ``dk``, ``dv`` (B, m, Hkv, d): in the accumulator dtype from the math
    path, in the input dtype from a fused kernel (callers add them into accumulator-dtype sums either way).
    ``out``: the rows' real output, when the caller has it (else a fused kernel gets :func:`out_for_delta`).
    ``backend``: ``"auto"`` (fused where it is available and, on CPU, fast for this dtype: see
    :func:`cpu_backward_choice`), ``"cpu_flash"``, ``"cuda"`` or ``"math"``. ``mask``: as in
    :func:`block_forward`."""
    which = _pick_backward(q, backend, mask)
    if which == "math":
        return math_backward(dout, q, k, v, lse, delta, causal, scale, mask)
    o = out if out is not None else out_for_delta(dout, delta)
    lse = lse.to(acc_dtype(q.dtype)).contiguous()
    if which == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            o.transpose(1, 2),
            lse,
            0.0,
            causal,
            attn_mask=_additive(mask, q),
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if which == "cuda":
        return _cuda_backward(dout, q, k, v, o, lse, causal, scale)
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")


def _pick_backward(q: torch.Tensor, backend: str, mask: torch.Tensor | None = None) -> str:
    """The forward's choice, except that on CPU the fused backward runs only where it is fast for the dtype."""
    which = _pick(q, backend, mask)
    if backend == "auto" and which == "cpu_flash":
        return cpu_backward_choice(q.dtype, q.shape[-1])
    return which


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
    o, lse = block_forward(q, k, v, False, d**-0.5)
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).transpose(1, 2).contiguous()
    best = {}
    for which in ("cpu_flash", "math"):
        times = []
        for _ in range(3):  # the first run warms up
            t0 = time.perf_counter()
            block_backward(do, q, k, v, lse, delta, False, d**-0.5, backend=which, out=o)
            times.append(time.perf_counter() - t0)
        best[which] = min(times[1:])
    return "math" if best["cpu_flash"] > _MATH_MARGIN * best["math"] else "cpu_flash"


# Which CUDA op runs a block, by dtype, head dim and compute capability. One H200, bf16, d=128 (the table shipped
# as tokenring/data/h200_sdpa.json): cuDNN runs 1.7-1.9x the flash op's TFLOP/s from 2K-token blocks up, forward
# and forward+backward, causal or not; the efficient op runs at about half of flash. So: cuDNN on sm90 and newer
# where it takes the head dim, flash on older GPUs and for head dims up to 256, the efficient op for fp32 (neither
# of the others takes it), the math path for everything else (float64, odd head dims).
CUDNN_MIN_CAPABILITY = (9, 0)


def cuda_kernel(dtype: torch.dtype, d: int, capability: tuple[int, int], nvidia: bool = True) -> str | None:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``None`` (math path) for blocks of ``dtype`` and head dim
    ``d`` on a GPU of compute ``capability`` (see the table above; no cuDNN unless ``nvidia``: ROCm has none)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if half and nvidia and d % 8 == 0 and d <= 128 and tuple(capability) >= CUDNN_MIN_CAPABILITY:
        return "cudnn"
    if half and d % 8 == 0 and d <= 256:
        return "flash"
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and d % 4 == 0:
        return "efficient"
    return None


cpu_backward_choice.cache_clear = _cpu_backward_measured.cache_clear


def _cuda_op(q: torch.Tensor) -> str | None:
    """:func:`cuda_kernel` for ``q``'s blocks on its GPU."""
    g = gpu(q.device)
    return cuda_kernel(q.dtype, q.shape[-1], g.capability, g.nvidia)


def needs_equal_heads(q: torch.Tensor, backend: str = "auto") -> bool:
    """Whether the kernel that runs ``q``'s blocks takes only K/V with as many heads as ``q`` (the CUDA
    memory-efficient op); then callers repeat a visiting K/V block's heads once, not the kernel per block.
    The CPU ops, cuDNN and flash on CUDA and the math path are GQA-native."""
    return backend in ("auto", "cuda") and is_cuda(q) and _cuda_op(q) == "efficient"


def _repeat_heads(k: torch.Tensor, H: int) -> torch.Tensor:
    """(B, H, m, d) from (B, Hkv, m, d): the fused CUDA ops take equal head counts."""
    return k if k.shape[1] == H else k.repeat_interleave(H // k.shape[1], dim=1)


def _sum_heads(dk: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B, Hkv, m, d) from per-query-head gradients (B, H, m, d): the query heads of a group share a K/V head."""
    B, H, m, d = dk.shape
    return dk if H == Hkv else dk.view(B, Hkv, H // Hkv, m, d).sum(2)


def _cuda_backward(dout, q, k, v, o, lse, causal, scale):
    n, m, H, Hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    # dO and O in one layout: cuDNN before 9.5.1 read dO with O's strides, and no op takes a 0 inner stride
    ot, dot = o.contiguous().transpose(1, 2), dout.contiguous().transpose(1, 2)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    op = _cuda_op(q)
    lse = _lse_for(op, lse)
    # Dropout is 0: the random-state arguments are never read.
    seed = torch.empty((), dtype=torch.long, device=q.device)
    if op == "cudnn":  # GQA-native: dK/dV come back with the K/V's heads
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse, seed, seed, None, None, None, n, m, 0.0, causal, scale=scale
        )
    elif op == "flash":  # GQA-native
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse, None, None, n, m, 0.0, causal, seed, seed, scale=scale
        )[:3]
    else:  # the efficient op takes equal heads
        dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dot,
            qt,
            _repeat_heads(kt, H),
            _repeat_heads(vt, H),
            None,
            ot,
            lse,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )[:3]
        dk, dv = _sum_heads(dk, Hkv), _sum_heads(dv, Hkv)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward in the accumulator dtype (any device and dtype), chunked over query rows (memory
    O(chunk * m)); consumes ``delta`` directly."""
    acc = acc_dtype(q.dtype)
    B, n, H, d = q.shape
    m, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    qg = _grouped(q, Hkv).to(acc)
    dog = _grouped(dout, Hkv).to(acc)
    kg = k.transpose(1, 2).unsqueeze(2).to(acc)  # (B, Hkv, 1, m, d)
    vt = v.transpose(1, 2).unsqueeze(2).to(acc).transpose(-1, -2)  # (B, Hkv, 1, d, m)
    kt = kg.transpose(-1, -2)
    lse_g = lse.to(acc).view(B, Hkv, g, n)
    delta_g = delta.to(acc).view(B, Hkv, g, n)
    dq = torch.empty_like(qg)
    dk = torch.zeros(B, Hkv, m, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    step = _chunk_rows(q, m)
    for r0 in range(0, n, step):
        qc, doc = qg[..., r0 : r0 + step, :], dog[..., r0 : r0 + step, :]
        c = qc.shape[-2]
        p = torch.exp(_scores(qc, kt, scale, causal, r0, mask) - lse_g[..., r0 : r0 + step].unsqueeze(-1))
        ds = p * (torch.matmul(doc, vt) - delta_g[..., r0 : r0 + step].unsqueeze(-1))
        dq[..., r0 : r0 + step, :] = torch.matmul(ds, kg) * scale
        # Sum over the g query heads sharing a K/V head by folding them into the row dimension.
        p2, ds2 = p.reshape(B, Hkv, g * c, m), ds.reshape(B, Hkv, g * c, m)
        dv += torch.matmul(p2.transpose(-1, -2), doc.reshape(B, Hkv, g * c, d))
        dk += torch.matmul(ds2.transpose(-1, -2), qc.reshape(B, Hkv, g * c, d)) * scale
    return _ungrouped(dq), dk.transpose(1, 2), dv.transpose(1, 2)
