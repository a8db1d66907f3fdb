"""Two-level (hierarchical) schedules over an ``m x n`` grid of ranks: ``n`` ranks per node, ``m`` nodes; any flat
schedule inside each node, K/V moving between nodes once per round (docs/schedules.md, "Two-level schedules").
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from fractions import Fraction
from functools import lru_cache

from ..schedules import (
    Compute,
    Message,
    Schedule,
    Step,
    all_own_pieces,
    block_pair,
    chunk,
    drop_empty_tail,
    part_intersection,
    part_rows,
    part_union,
    relay,
)
from .base import RelayOrDirect, chunk_choices, lookaheads, outer_choices
from .direct import direct_steps
from .ring import pass_kv_steps
from .token_ring import pass_q_steps

__all__ = ["two_level", "TwoLevel", "inner_size_error"]

_KV_SIDE = ("kv", "dkv")  # message kinds about K/V (owner: the K/V's rank); the others are about queries


def inner_size_error(name: str, P: int, n: int) -> str | None:
    """Why ``n`` ranks per node cannot split ``P`` ranks for strategy ``name`` (``None``: it can)."""
    if n <= 0:
        return (
            f"strategy {name!r} runs over nodes of inner_size ranks: pass tokenring.attention(..., "
            f"inner_size=N) (ranks per node), set $LOCAL_WORLD_SIZE (torchrun does), or name it "
            f"'{name.split(':')[0]}:n=N'"
        )
    if P % n:
        return (
            f"strategy {name!r}: {P} ranks do not split into nodes of {n} (inner_size must divide the group "
            f"size); use a divisor of {P}"
        )
    return None


def two_level(
    name: str,
    P: int,
    n: int,
    layout: str,
    causal: bool,
    backward: bool,
    mask,
    inner,
    keep: bool = False,
    outer: int = 1,
) -> Schedule:
    """Compose ``inner(pair) -> list[Step]`` (a flat schedule over ``n`` local ranks) with a ring of K/V between
    the ``P / n`` nodes (``keep``, ``outer``: docs/schedules.md)."""
    m = P // n
    # slots in time order: the own round, then each visiting round's sub-rounds (keep's backward: own round last)
    visits = [(o, i) for o in range(1, m) for i in range(outer)]
    late = backward and keep
    order = visits + [(0, 0)] if late else [(0, 0)] + visits
    slot = {key: x for x, key in enumerate(order)}
    rounds, built = _rounds(order, P, n, layout, causal, mask, inner, outer)
    stride = max(1 + max((t for t, st in enumerate(sch) if st.computes), default=0) for sch in rounds.values())
    out: list[Step] = []
    home: list[tuple[int, Message]] = []  # (step to post, message): dK/dV a node made for another node's K/V
    for (o, i, a), steps in rounds.items():
        home += _place(out, steps, m, n, o, a, slot[o, i] * stride, backward)
    end = max(len(out), max((t for t, _ in home), default=0) + 1)
    for t, msg in home:  # due a round later (or at the end): the holder computes on meanwhile
        _at(out, t).messages.append(replace(msg, due=min(t + outer * stride, end - 1)))
    if not late:
        _outer_ring(out, rounds, built, slot, stride, m, n, outer)
    q_kind = "qgrad" if backward else "q"
    return Schedule(name, P, layout, causal, backward, q_kind, drop_empty_tail(out), mask)


def _g(a: int, l: int, m: int, n: int) -> int:
    """Global rank of local rank ``l`` on node ``a`` (mod the ``m`` nodes)."""
    return (a % m) * n + l


def _at(out: list[Step], t: int) -> Step:
    """Step ``t`` of ``out``, growing it as needed."""
    while len(out) <= t:
        out.append(Step())
    return out[t]


def _cut(pairs: tuple, i: int, n: int, outer: int, s: int | None) -> tuple:
    """Sub-round ``i`` of a visiting round: each pair's K/V rows within chunk ``i`` of ``outer``."""
    hull = [None] * n
    for x, got in enumerate(pairs):
        if got is not None:
            hull[x % n] = part_union(hull[x % n], got[1])
    out = []
    for x, got in enumerate(pairs):
        kv = None if got is None else part_intersection(got[1], chunk(hull[x % n], i, outer))
        out.append(None if kv is None or (s is not None and not part_rows(kv, s)) else (got[0], kv, got[2]))
    return tuple(out)


def _rounds(order, P: int, n: int, layout: str, causal: bool, mask, inner, outer: int) -> tuple[dict, dict]:
    """The inner schedule of every (visit, sub-round, node), and the distinct ones by which blocks meet."""
    m, s = P // n, None if mask is None else mask.S // P
    rounds, built = {}, {}
    for o, i in order:
        for a in range(m):
            b = a - o
            pairs = tuple(
                block_pair(_g(a, j, m, n), _g(b, l, m, n), P, layout, causal, mask) for j in range(n) for l in range(n)
            )
            if o and outer > 1:
                pairs = _cut(pairs, i, n, outer, s)
            if pairs not in built:  # rounds whose blocks meet alike share one inner schedule (most of them)
                built[pairs] = inner(lambda j, l, pairs=pairs: pairs[j * n + l])
            rounds[o, i, a] = built[pairs]
    return rounds, built


def _place(out: list[Step], steps, m: int, n: int, o: int, a: int, base: int, backward: bool) -> list:
    """Node ``a``'s round against node ``a - o``'s K/V, from step ``base`` of ``out``: its computes and messages
    in global ranks; returns the dK/dV messages home (``(step to post, message)``) a visiting round makes."""
    b = a - o
    last_add: dict[int, int] = {}  # local K/V owner -> last step its dK/dV grows on its holder this round
    part: dict[int, str | None] = {}  # local K/V owner -> rows this node computed against
    qa, kb = a % m * n, b % m * n  # node a's first rank (queries), node b's (K/V)
    for t, st in enumerate(steps):
        step = _at(out, base + t)
        for c in st.computes:
            step.computes.append(
                Compute(qa + c.rank, qa + c.q_owner, c.q_part, kb + c.kv_owner, c.kv_part, c.diag, c.heads)
            )
            if backward:
                part[c.kv_owner] = part_union(part.get(c.kv_owner), c.kv_part)
                if c.rank == c.kv_owner:
                    last_add[c.kv_owner] = max(last_add.get(c.kv_owner, 0), t)
        for x in st.messages:
            owner = (kb if x.kind in _KV_SIDE else qa) + x.owner
            due, ready = (y + base if y >= 0 else -1 for y in (x.due, x.ready))
            step.messages.append(Message(qa + x.src, qa + x.dst, x.kind, owner, x.part, x.heads, due, ready))
            if x.kind == "dkv" and x.dst == x.owner:
                last_add[x.owner] = max(last_add.get(x.owner, 0), max(t, x.due))
    if not (backward and o):
        return []
    return [
        (base + last_add.get(l, 0) + 1, Message(_g(a, l, m, n), _g(b, l, m, n), "dkv", _g(b, l, m, n), rows_))
        for l, rows_ in part.items()
    ]


def _outer_ring(out: list[Step], rounds: dict, built: dict, slot: dict, stride: int, m: int, n: int, outer: int):
    """The outer ring: each K/V block visits the nodes after its own, one round each, sub-round by sub-round."""
    held = {id(steps): _held_rows(steps, n) for steps in built.values()}
    for b in range(m):
        for l, i in itertools.product(range(n), range(outer)):
            path = [_g(b + o, l, m, n) for o in range(1, m)]
            needs = [held[id(rounds[o, i, (b + o) % m])][l] for o in range(1, m)]
            for h, msg in relay(_g(b, l, m, n), path, needs, "kv"):
                # posted a round before the sub-round that reads it (the first hop: at once), due just before
                need = slot[h + 1, i]
                _at(out, max(0, need - outer) * stride).messages.append(replace(msg, due=need * stride - 1))


@lru_cache(maxsize=1024)
def _kept(st: "TwoLevel", P: int, layout: str, causal: bool, mask, me: int) -> list[tuple[int, str]]:
    """Once per call shape and rank (a schedule has ~P^2 messages): the forward's outer-ring K/V for ``me``."""
    n = st.inner
    sched = st.schedule(P, layout, causal, False, mask)
    return [
        (x.owner, x.part)
        for step in sched.steps
        for x in step.messages
        if x.dst == me and x.kind == "kv" and x.owner % n == me % n and x.owner // n != me // n
    ]


def _held_rows(steps: list[Step], n: int) -> list[str | None]:
    """Per local rank of an inner schedule: the rows of the K/V block it holds that it reads (computes against
    or sends on), i.e. what the outer ring must have brought it."""
    need: list[str | None] = [None] * n
    for st in steps:
        for c in st.computes:
            if c.rank == c.kv_owner:
                need[c.rank] = part_union(need[c.rank], c.kv_part)
        for x in st.messages:
            if x.kind == "kv" and x.src == x.owner:
                need[x.src] = part_union(need[x.src], x.part)
    return need


class TwoLevel(RelayOrDirect):
    """A flat family run inside each node of ``inner`` ranks (0: not known yet), with a ring of K/V between
    nodes (:func:`two_level`)."""

    hierarchical = True
    PARAMS = ("mode", "chunks", "lookahead", "inner", "keep", "outer")

    def __init__(
        self,
        mode: str | None = None,
        chunks: int = 1,
        lookahead: int = 1,
        inner: int = 0,
        keep: bool = False,
        outer: int = 1,
    ):
        super().__init__(mode, chunks, lookahead)
        self.inner, self.keep, self.outer = int(inner), bool(keep), int(outer)
        if self.inner < 0:
            raise ValueError(f"{self.family}: the node size n= must be positive, got {inner}")
        if self.outer < 1:
            raise ValueError(f"{self.family}: the outer chunks o= must be at least 1, got {outer}")
        self.name = self.spec.text(self.default_mode)

    def with_inner(self, n: int) -> "TwoLevel":
        return self.make(replace(self.spec, inner=n))

    def variants(self, P: int) -> list["TwoLevel"]:
        if self.mode != "auto":
            return [self]
        n, cls, keep = self.inner, type(self), self.keep
        # as for flat families, fewer candidates on large groups (each is a simulation of ~P^2 blocks)
        ks = lookaheads(n) if P <= 64 else sorted({1, max(1, n - 1)})
        os_ = sorted({1, self.outer} | set(outer_choices(P // n if n else 1)))
        return [cls("relay", inner=n, keep=keep, outer=o) for o in os_] + [
            cls("direct", c, k, n, keep, o) for c in chunk_choices(P) for k in ks for o in os_
        ]

    def kept_pieces(self, cfg) -> list[tuple[int, str]]:
        """With ``keep``: the K/V pieces the outer ring brings this rank in forward, in schedule order."""
        return _kept(self, cfg.P, cfg.layout, cfg.causal, cfg.mask, cfg.rank) if self.keep else []

    def check(self, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
        why = inner_size_error(self.name, P, self.inner) or super().check(H, Hkv, self.inner, s, zigzag)
        if why or s is None:
            return why
        halves = ("lo", "hi") if zigzag else ("all",)
        # outer chunks of a visiting K/V block (half of one, zigzag), each cut again into c by a direct pass-KV
        pieces = self.outer * (self.chunks if self.mover == "kv" and self.mode == "direct" else 1)
        if any(part_rows(chunk(h, i, pieces), s) == 0 for h in halves for i in range(pieces)):
            return (
                f"{self.name}: a visiting K/V block is cut into {pieces} row pieces but this rank has {s} rows"
                f"{' (halves of it)' if zigzag else ''}; use fewer outer chunks (o=), chunks (c=) or a longer "
                f"sequence"
            )
        if self.mode != "direct":
            return None
        # a visiting block at a rank's own place may meet half its queries, cut like the own block
        own = all_own_pieces(self.chunks, self.inner, self.mover)
        if any(part_rows(chunk(h, a, n, b), s) == 0 for h in halves for a, b, n in own):
            smallest = min(Fraction(b - a, n) for a, b, n in own)
            return (
                f"{self.name}: the inner schedule cuts a rank's {'half ' if zigzag else ''}block into "
                f"pieces (the smallest: {smallest} of its rows) but this rank has {s} rows; use fewer chunks "
                f"(c=) or a longer sequence"
            )
        return None

    def build_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        """The whole schedule, ``only`` or not (a two-level schedule is not built per rank)."""
        why = inner_size_error(self.name, P, self.inner)
        if why:
            raise ValueError(why)
        if self.mode == "auto":
            return super().build_schedule(P, layout, causal, backward, mask)  # says: resolve it first
        n, s = self.inner, None if mask is None else mask.S // P

        def inner(pair):
            if self.mode == "direct":
                return direct_steps(n, pair, causal, backward, self.mover, self.chunks, self.lookahead, s)
            return (pass_kv_steps if self.mover == "kv" else pass_q_steps)(n, pair, backward)

        return two_level(self.name, P, n, layout, causal, backward, mask, inner, self.keep, self.outer)
