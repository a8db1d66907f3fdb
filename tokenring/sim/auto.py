"""``strategy="auto"``: pick the strategy the cost model predicts fastest, and say why (which topology and kernel
model it uses, and how the choice is shared and cached: docs/sim.md, "auto").
"""

from __future__ import annotations

import io
import sys

import torch

from .. import settings
from ..device import device_type as device_kind
from ..device import gpu
from ..kernels import CUDNN_MIN_CAPABILITY, REGISTRY, cuda_kernel
from ..layouts import default_layout, group_info
from ..schedules import Shapes
from ..strategies import why_not
from .kernel_model import cpu_share, kernel_model
from .simulator import AUTO_STRATEGIES, SimResult, fastest, simulate, variant_candidates
from .topology import Topology, detected_topology, get_topology, profile_summary

__all__ = ["set_topology", "get_current_topology", "choose", "explain", "DEFAULT_TOPOLOGY"]

DEFAULT_TOPOLOGY = {"cpu": "loopback"}
_cache: dict = {}


def set_topology(spec=None) -> None:
    """Tell ``auto`` which interconnect the group runs on (``None``: back to ``$TOKENRING_TOPOLOGY`` / default);
    ``tokenring.configure(topology=spec)``. Rank 0's topology decides for every rank; it applies to call
    signatures not agreed yet (``tokenring.forget_choices()`` on every rank re-decides the others): a change on
    one rank alone must not make it re-agree a call the others skip."""
    settings.configure(topology=spec)


def _forget(name: str) -> None:
    if name == "topology":
        _cache.clear()


settings.on_change(_forget)


def get_current_topology(P: int, device_type: str = "cpu") -> tuple[Topology, str]:
    """The topology ``auto`` uses for ``P`` ranks and where it came from."""
    spec, origin = settings.source("topology")
    if spec is not None:
        return get_topology(spec, P), "tokenring.set_topology" if origin == "tokenring.configure" else origin
    if device_type == "cuda":
        g = gpu()
        return detected_topology(g, P), (
            f"detected: {g.name} (sm{g.capability[0]}{g.capability[1]}), {g.per_node} per node, {g.link}"
        )
    name = DEFAULT_TOPOLOGY.get(device_type, "loopback")
    return get_topology(name, P), f"default for {device_type} (set tokenring.set_topology or $TOKENRING_TOPOLOGY)"


def _kernel(topo: Topology, P: int):
    """The topology's measured kernel model if it has one (a :func:`tokenring.calibrate` profile), else its
    device's; on CPU the analytic one, for local ranks sharing this host's cores."""
    if topo.kernel is not None:
        return topo.kernel
    if topo.device == "cpu":
        threads = torch.get_num_threads()
        return kernel_model("cpu", threads, share=cpu_share(P, threads))
    return kernel_model(topo.device)


def node_sizes(topo: Topology, P: int, inner: int = 0) -> tuple[int, ...]:
    """Node sizes ``auto`` tries for the hierarchical strategies (docs/sim.md, "auto")."""
    sizes = {inner} if inner else set()
    node = getattr(topo, "node", None)
    if node is not None:
        sizes |= {k for k in range(2, node.P + 1) if node.P % k == 0}
    return tuple(sorted(k for k in sizes if 1 < k < P and P % k == 0))


def _evaluate(
    sh: Shapes, causal: bool, layout: str, backward: bool, topo: Topology, requested: str, mask=None, inner: int = 0
) -> list[SimResult]:
    km = _kernel(topo, sh.P)
    return [
        simulate(n, sh, topo, km, causal=causal, layout=layout, backward=backward, mask=mask)
        for n in variant_candidates(requested, sh, causal, layout, node_sizes(topo, sh.P, inner))
    ]


def choose(
    sh: Shapes,
    causal: bool,
    layout: str,
    backward: bool = True,
    device_type: str = "cpu",
    topology=None,
    requested: str = "auto",
    mask=None,
    inner: int = 0,
) -> tuple[str, list[SimResult], Topology, str]:
    """``(strategy, predictions, topology, where the topology came from)`` for ``requested``: the fastest
    prediction, ties (within 0.5%) to the earlier candidate."""
    if topology is not None:
        topo, origin = get_topology(topology, sh.P), "argument"
    else:
        topo, origin = get_current_topology(sh.P, device_type)
    key = (
        sh,
        causal,
        layout,
        backward,
        topo.name,
        topo.P,
        repr(settings.get("topology")),
        torch.get_num_threads(),
        topology if isinstance(topology, (str, type(None))) else repr(topology),
        requested,
        mask_class(mask),
        inner,
    )
    if key not in _cache:
        results = _evaluate(sh, causal, layout, backward, topo, requested, mask, inner)
        if not results:
            raise ValueError(
                f"no variant of {requested!r} can run B={sh.B} s={sh.s} H={sh.H} Hkv={sh.Hkv} on P={sh.P} ranks"
            )
        while len(_cache) >= _CACHE_SIZE:  # oldest first out (only rank 0 decides: nothing to keep in step)
            _cache.pop(next(iter(_cache)))
        _cache[key] = (fastest(results).strategy, results, topo, origin)
    return _cache[key]


_CACHE_SIZE = 512


def mask_class(mask) -> tuple | None:
    """What of a mask a choice is kept for: its window, and its number of documents to a power of two (a new
    mask every step would cost a simulation each; docs/sim.md)."""
    return None if mask is None else (mask.left, mask.right, mask.causal, mask.documents.bit_length())


def _kernel_choice(dtype, d: int) -> str:
    """Which CUDA op runs this rank's blocks, and why (tokenring.kernels.cuda_kernel's table)."""
    g = gpu()
    cap = g.capability
    op = cuda_kernel(dtype, d, cap, g.nvidia)
    why = {
        "cudnn": f"cuDNN on sm{CUDNN_MIN_CAPABILITY[0]}{CUDNN_MIN_CAPABILITY[1]}+ for fp16/bf16, head dim <= 128 "
        f"(1.7-1.9x the flash op on an H200)",
        "flash": "flash for fp16/bf16 below sm90 or head dim 129-256",
        "efficient": "memory-efficient for fp32 (or head dims flash does not take)",
        None: "no fused op takes this dtype / head dim: the math path",
    }[op]
    return f"{op or 'math'} ({str(dtype).replace('torch.', '')}, d={d}, sm{cap[0]}{cap[1]}: {why})"


def fmt_time(t: float) -> str:
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= f or unit == "us":
            return f"{t / f:.4g} {unit}"
    return ""


def _shape(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)


def _print_setup(out, sh: Shapes, causal, layout, backward, strategy, device_type, topo: Topology, origin) -> None:
    """The call, topology, kernel model and kernel backends a choice was made for, as ``explain``'s header."""
    B, s, H, Hkv, d, dtype, P = sh.B, sh.s, sh.H, sh.Hkv, sh.d, sh.dtype, sh.P
    print(
        f"tokenring.auto: B={B} S={s * P} (s={s}/rank) H={H} Hkv={Hkv} d={d} {str(dtype).replace('torch.', '')} "
        f"P={P} causal={causal} layout={layout} {'forward+backward' if backward else 'forward'}; "
        f"strategy={strategy!r}",
        file=out,
    )
    print(f"topology: {topo.describe()} [{origin}]; kernel model: {_kernel(topo, P).name}", file=out)
    if topo.measured:
        print(profile_summary(topo), file=out)
    if device_type == "cuda":
        print(f"block kernel: {_kernel_choice(dtype, d)}", file=out)
    print("kernel backends, first that takes a block: " + "; ".join(b.describe() for b in REGISTRY.values()), file=out)


def _print_table(out, results: list[SimResult]) -> None:
    """Every candidate's predicted time and its parts, fastest first, as ``explain``'s table."""
    best = min(r.time for r in results)
    w = max(12, *(len(r.strategy) + 1 for r in results))
    factors = any(r.factor != 1.0 for r in results)  # a calibrated profile's per-schedule corrections
    print(
        f"{'strategy':<{w}}{'predicted':>12}{'vs best':>9}{'compute':>12}{'exposed comm':>14}"
        f"{'MB sent/rank':>14}  regime" + ("         measured factor" if factors else ""),
        file=out,
    )
    for r in sorted(results, key=lambda r: r.time):
        mb = sum(p.bytes_per_rank for p in r.passes) / 1e6
        print(
            f"{r.strategy:<{w}}{fmt_time(r.time):>12}{r.time / best:>8.2f}x{fmt_time(r.compute):>12}"
            f"{fmt_time(r.exposed_comm):>14}{mb:>14.2f}  {r.regime:<13}"
            + (f"x{r.factor:.3f}".rjust(18) if factors else ""),
            file=out,
        )


def explain(
    q,
    k=None,
    *,
    causal: bool = False,
    layout: str | None = None,
    P: int | None = None,
    group=None,
    topology=None,
    backward: bool = True,
    dtype=None,
    strategy: str = "auto",
    file="stdout",
    device_type: str | None = None,
) -> str:
    """Print (to ``file``) and return why ``strategy`` runs the variant it runs for this rank's shard ``q``
    (B, s, H, d) and ``k`` (B, s, Hkv, d) on ``P`` ranks: every candidate's predicted time, fastest first."""
    qs = _shape(q)
    ks = _shape(k) if k is not None else qs
    if len(qs) != 4 or len(ks) != 4:
        raise ValueError(f"explain takes this rank's q (B, s, H, d) and k (B, s, Hkv, d); got {qs} and {ks}")
    if P is None:
        P = group_info(group)[1]
    B, s, H, d = qs
    if dtype is None:
        dtype = q.dtype if isinstance(q, torch.Tensor) else torch.bfloat16
    if device_type is None:
        device_type = device_kind(q) if isinstance(q, torch.Tensor) else "cpu"
    layout = layout or default_layout(causal)
    sh = Shapes(B, s, H, ks[2], d, dtype, P)
    out = io.StringIO()
    if P < 2:
        print("tokenring.auto: one rank: plain single-device attention, no strategy needed.", file=out)
    else:
        name, results, topo, origin = choose(sh, causal, layout, backward, device_type, topology, strategy)
        _print_setup(out, sh, causal, layout, backward, strategy, device_type, topo, origin)
        _print_table(out, results)

        for fam in AUTO_STRATEGIES:
            why = why_not(fam, H, ks[2], P)
            if why:
                print(f"({fam} not a candidate: {why})", file=out)
        print(f"-> {name}", file=out)
    text = out.getvalue()
    if file is not None:
        print(text, end="", file=sys.stdout if file == "stdout" else file)
    return text
