"""Rank functions for tests/test_calibrate.py (importable by spawned ranks)."""

from __future__ import annotations

import os
import time

import torch

import tokenring

SMALL = dict(seq=96, heads=3, kv_heads=1, head_dim=8, repeats=1, message_bytes=64 << 10)


def profile_case(rank: int, P: int) -> dict:
    """A quick calibration on every rank; its profile as a dict, and whether auto then uses it."""
    prof = tokenring.calibrate(**SMALL)
    tokenring.set_topology(prof)
    try:
        from tokenring.sim.auto import _kernel, get_current_topology

        topo, _ = get_current_topology(P)
        out = prof.to_dict()
        out["auto_kernel"] = _kernel(topo, P).name
        # the profile's group still runs attention correctly afterwards (tags and buffers left clean)
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(1, 8, 2, 8, generator=g, dtype=torch.float64)
        tokenring.attention(q, q, q, strategy="auto")
        return out
    finally:
        tokenring.set_topology(None)


def dies_case(rank: int, P: int, timeout: float) -> tuple[str, float, str]:
    """Rank P-1 exits while the pair bandwidths are being measured; the others' error and how long it took."""
    from tokenring import calibration as cal

    tokenring.set_timeout(timeout)
    if rank == P - 1:
        real = cal._pair_alone

        def dying(g, src, dst, nbytes, repeats):
            if nbytes > 1:
                os._exit(3)
            return real(g, src, dst, nbytes, repeats)

        cal._pair_alone = dying
    t0 = time.monotonic()
    try:
        tokenring.calibrate(**SMALL)
    except RuntimeError as e:
        return type(e).__name__, time.monotonic() - t0, str(e)
    raise AssertionError(f"rank {rank}: calibrate finished although rank {P - 1} died")


def lazy_case(rank: int, P: int) -> tuple[str, float, int]:
    """``calibrate=1``: the first auto call calibrates the group, the second does not; results stay exact.
    ``(topology name, worst error vs one process, calibrations run)``."""
    from tokenring import calibration as cal
    from tokenring import ops
    from tokenring.layouts import shard

    runs = []
    real = cal.calibrate

    def counted(*a, **kw):
        runs.append(1)
        return real(*a, **dict(kw, repeats=1, message_bytes=64 << 10))

    cal.calibrate = counted
    tokenring.configure(calibrate=True)
    try:
        g = torch.Generator().manual_seed(0)
        S = 8 * P
        q, k, v = (torch.randn(1, S, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.repeat_interleave(2, 2).transpose(1, 2),
            v.repeat_interleave(2, 2).transpose(1, 2),
            is_causal=True,
        ).transpose(1, 2)
        worst = 0.0
        for _ in range(2):
            out = tokenring.attention(*(shard(x, 1, "zigzag") for x in (q, k, v)), causal=True)
            worst = max(worst, (out - shard(ref, 1, "zigzag")).abs().max().item())
        from tokenring import settings

        return settings.get("topology").topology.name, worst, len(runs)
    finally:
        cal.calibrate = real
        ops._calibrated.clear()
        tokenring.configure(calibrate=None, topology=None)


def subgroup_case(rank: int, P: int) -> str | None:
    """Ranks 1..P-1 calibrate on their own subgroup (as the context-parallel group of a mesh); rank 0 does not."""
    import torch.distributed as dist

    group = dist.new_group(list(range(1, P)))
    if rank == 0:
        return None
    prof = tokenring.calibrate(group, **SMALL)
    return prof.topology.name if prof.measured["P"] == P - 1 else "wrong P"
