"""Ring attention (pass-KV): queries stay home, K/V travel ``r -> r + 1`` one hop per step; ``ring:direct`` and
``ring:auto`` as for TokenRing (docs/schedules.md, "Ring attention").
"""

from __future__ import annotations

from ..schedules import (
    Compute,
    Message,
    Schedule,
    Step,
    drop_empty_tail,
    pairing,
    part_union,
    relay,
    relay_through,
    rows,
)
from .base import RelayOrDirect

__all__ = ["pass_kv", "pass_kv_steps", "Ring", "STRATEGY"]

ONE_WAY = (("all", +1),)


def pass_kv(
    P: int,
    layout: str,
    causal: bool,
    backward: bool,
    lanes=ONE_WAY,
    name: str = "ring",
    mask=None,
    only: int | None = None,
) -> Schedule:
    steps = pass_kv_steps(P, pairing(P, layout, causal, mask), backward, lanes, only)
    q_kind = "qgrad" if backward else "q"
    return Schedule(name, P, layout, causal, backward, q_kind, drop_empty_tail(steps), mask, only)


def pass_kv_steps(P: int, pair, backward: bool, lanes=ONE_WAY, only: int | None = None) -> list[Step]:
    """The steps of :func:`pass_kv` for blocks that meet as ``pair`` says (``only``: that rank's part alone)."""
    steps = [Step() for _ in range(P + 1)]
    table = getattr(pair, "table", None)  # masked: row ranges for the unions without building parts
    for i in range(P):
        if only in (None, i):
            own = pair(i, i)
            if own is not None:
                steps[0].computes.append(Compute(i, i, own[0], i, own[1], own[2]))
        for heads, sign in lanes:
            path = [(i + sign * t) % P for t in range(1, P)]
            fast = only is not None and table is not None
            pairs = [pair(r, i) if not fast or r == only else None for r in path]  # fast: `only`'s compute alone
            for t, (r, got) in enumerate(zip(path, pairs), start=1):
                if got is not None:
                    steps[t].computes.append(Compute(r, r, got[0], i, got[1], got[2], heads=heads))
            if fast:
                need = table.needs(i, "kv")
                hops = relay_through(i, path, need, "kv", only, pair.s, heads)
            else:
                needs = [(p[1] if p else None) for p in pairs]
                hops = [(t, m) for t, m in relay(i, path, needs, "kv", heads) if only in (None, m.src, m.dst)]
            for t, m in hops:
                steps[t].messages.append(m)
            if backward:
                chain = (
                    _dkv_chain_through(i, path, heads, need, pair.s, only)
                    if fast
                    else _dkv_chain(i, path, heads, pairs)
                )
                for t, m in chain:
                    if only in (None, m.src, m.dst):
                        steps[t].messages.append(m)
    if only is not None:
        for st in steps:
            st.computes = [c for c in st.computes if c.rank == only]
    # order computes by rank for readable traces
    for st in steps:
        st.computes.sort(key=lambda c: c.rank)
    return steps


def _dkv_chain(i: int, path: list[int], heads: str, pairs) -> list[tuple[int, Message]]:
    """The dK/dV accumulator of K/V_i: from each contributor on ``path`` to the next, then home to ``i``."""
    out, acc, holder, t_held = [], None, None, 0
    for t, (r, got) in enumerate(zip(path, pairs), start=1):
        if got is None:
            continue
        if holder is not None:
            out.append((t_held + 1, Message(holder, r, "dkv", i, acc, heads)))
        acc, holder, t_held = part_union(acc, got[1]), r, t
    if holder is not None:
        out.append((t_held + 1, Message(holder, i, "dkv", i, acc, heads)))
    return out


def _dkv_chain_through(i: int, path: list[int], heads: str, need, s: int, only: int) -> list[tuple[int, Message]]:
    """The messages of :func:`_dkv_chain` to and from rank ``only``, from ``need = (live, lo, hi)`` per rank."""
    live, lo_of, hi_of = need
    out, lo, hi, holder, t_held = [], None, None, None, 0
    for t, r in enumerate(path, start=1):
        if not live[r]:
            continue
        if holder is not None and only in (holder, r):
            out.append((t_held + 1, Message(holder, r, "dkv", i, rows(lo, hi, s), heads)))
        if holder == only:
            return out  # `only`'s successor found: nothing later involves it
        lo, hi = (lo_of[r], hi_of[r]) if lo is None else (min(lo, lo_of[r]), max(hi, hi_of[r]))
        holder, t_held = r, t
    if holder is not None and only in (holder, i):
        out.append((t_held + 1, Message(holder, i, "dkv", i, rows(lo, hi, s), heads)))
    return out


class Ring(RelayOrDirect):
    """``ring`` alone: the classic ring; ``ring:direct,c=C,k=K``: the direct one; ``ring:auto``: the cost
    model picks."""

    family, default_mode, mover = "ring", "relay", "kv"

    def relay_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        return pass_kv(P, layout, causal, backward, mask=mask, only=only)


STRATEGY = Ring()
