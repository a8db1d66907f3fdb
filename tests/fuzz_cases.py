"""Random calls of ``tokenring.attention``, valid and invalid, for tests/test_fuzz.py (a CI sample) and
bench/fuzz.py (the long run). Rules checked on every rank:

- a valid call equals float64 attention over the whole sequence, forward and backward, within the dtype's
  tolerance (float64 1e-9, float32 1e-5, bfloat16 2e-2) relative to this rank's largest reference value, or to
  0.1 * sqrt(d) where that is larger (cases.check_case: gradients that are 0 in theory, as with one-token
  documents or a window of 0, come out as rounding noise); the sinks' gradient, summed over the ranks' shares,
  relative to the sum of the shares' sizes where larger, within 5e-2 in bfloat16 (one process reaches a few 1e-2);
- or, where an error is over that tolerance, it is at most ``ONE_PROCESS`` times the same call's error in one
  process (the same inputs, tokenring on a group of one rank: the kernels' own rounding of these values, as in
  float32 dq with a window of 0-2 keys); the call is recorded with both errors;
- an invalid call raises a ValueError on every rank, and the valid call after it still equals the reference
  (the group stays usable).

A valid call out of both bounds is recorded as failed (``ok`` False, the errors named) and the run goes on: every
rank makes the same collectives whatever its errors.
"""

from __future__ import annotations

import math
import random

import cases
import torch
import torch.distributed as dist

from tokenring.strategies import ALIASES, FAMILIES, HIERARCHICAL, why_not

ONE_PROCESS = 2.0  # a distributed call's error may be up to this many times the same call's in one process

# Refusals that hold at any P (cases.expect_error builds their tensors).
INVALID = [
    "head_ratio", "batch", "length", "head_dim", "dtype", "device", "ranks_differ", "zigzag_odd", "bidir_odd_kv",
    "bad_strategy", "bad_layout", "cu_sum", "cu_ranks_differ", "cu_bad_on_one_rank", "window_bad",
    "zigzag_odd_one_rank", "bad_strategy_one_rank", "chunks_one_rank", "shape_one_rank", "scale_one_rank",
    "head_dim_zero", "window_one_rank", "inner_indivisible",
]  # fmt: skip


def _documents(rng: random.Random, S: int) -> list[int]:
    """Random document bounds over S tokens, short documents (1, 2, 3 tokens) among them."""
    cuts = sorted(rng.sample(range(1, S), rng.randint(1, min(4, S - 1)))) if S > 1 else []
    return [0, *cuts, S]


def draw(rng: random.Random, P: int) -> dict:
    """One valid call's case (cases.check_case's keys) at P ranks."""
    Hkv = rng.choice([1, 2, 3, 4])
    H = Hkv * rng.choice([1, 2, 3])
    causal = rng.random() < 0.6
    layout = rng.choice(["contiguous", "zigzag"])
    s = 2 * rng.randint(1, 6)
    d = rng.choice([1, 3, 8, 16, 24, 40, 64, 72])
    dtype = rng.choice(["float64", "float32"] + (["bfloat16"] if d >= 8 else []))
    c, k = rng.randint(1, 3), rng.randint(1, max(1, P - 1))
    names = [f for f in FAMILIES if f not in HIERARCHICAL] + list(ALIASES) + ["auto"]
    names += [f"token_ring:direct,c={c},k={k}", f"ring:direct,c={c},k={k}"]
    if P % 2 == 0 and P > 2:
        names += [f"usp:n={P // 2}", f"double_ring:n={P // 2}", f"token_ring_2d:n={P // 2}"]
    ok = [n for n in names if n == "auto" or why_not(n, H, Hkv, P, s, causal and layout == "zigzag") is None]
    case = dict(
        B=rng.randint(1, 2), s=s, H=H, Hkv=Hkv, d=d, dtype=dtype, causal=causal, layout=layout,
        strategy=rng.choice(ok), scale=rng.choice([None, None, 0.3, -0.5, 0.0]), seed=rng.randrange(2**16),
    )  # fmt: skip
    r = rng.random()
    if r < 0.3:
        case["cu_seqlens"] = _documents(rng, s * P)
    elif r < 0.45:
        case["window"] = (rng.choice([-1, 0, 1, 3]), rng.choice([-1, 0, 2]))
    if rng.random() < 0.2:
        case["sinks"] = True
    if rng.random() < 0.1 and d >= 8:
        case["dv"] = rng.choice([d // 2, d + 8])
    return case


def draw_calls(seed: int, P: int, n: int, invalid_share: float = 0.25) -> list[dict]:
    """``n`` calls: valid cases, and ``{"invalid": kind}`` entries (each run followed by the next valid one)."""
    rng = random.Random(seed * 1000 + P)
    return [{"invalid": rng.choice(INVALID)} if rng.random() < invalid_share else draw(rng, P) for _ in range(n)]


def run_calls(rank: int, P: int, calls: list[dict]) -> list[dict]:
    """Every call on this rank: ``{"kind", "ok", "err" or "message"}``; a wrong result or a missing refusal
    raises (so the pool reports the rank and the case)."""
    out = []
    for call in calls:
        if "invalid" in call:
            out.append(dict(kind=call["invalid"], ok=True, message=cases.expect_error(rank, P, call["invalid"])))
            continue
        out.append(_valid(rank, P, call))
    return out


_solo: dict = {}  # this rank's group of one, per world


def _valid(rank: int, P: int, call: dict) -> dict:
    """One valid call: its errors against float64, and where one is over the dtype's tolerance, the same call's
    errors in one process (see the module's rules)."""
    tol = cases.TOL[getattr(torch, call["dtype"])]
    errs = cases.check_case(rank, P, call, tol=math.inf)
    sinks_tol = max(tol, 5e-2) if call["dtype"] == "bfloat16" else tol  # as cases.check_case
    over = {name: e for name, e in errs.items() if not e <= (sinks_tol if name == "dsinks" else tol)}
    if not over:
        return dict(kind="valid", ok=True, err=max(errs.values()), case=call)
    if P not in _solo:
        _solo[P] = dist.new_group([rank], use_local_synchronization=True)
    alone = dict(call, s=call["s"] * P, strategy="ring")
    solo = cases.check_case(0, 1, alone, tol=math.inf, group=_solo[P])
    bad = {name: (e, solo[name]) for name, e in over.items() if not e <= ONE_PROCESS * solo[name]}
    return dict(
        kind="valid", ok=not bad, err=max(errs.values()), case=call, one_process=solo,
        failed=None if not bad else f"rank {rank}/{P}: " + ", ".join(
            f"{name} {e:.3g} > {tol:g} and > {ONE_PROCESS:g} x one process's {s1:.3g}" for name, (e, s1) in bad.items()
        ),
    )  # fmt: skip
