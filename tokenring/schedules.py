"""Schedules as plain data: which block each rank computes at each step and which messages travel meanwhile.

A strategy is a :class:`Schedule`. The executor (``executor.py``) runs it on real tensors over
``torch.distributed``; the simulator runs the very same object on a topology model, so predictions and
reality use one description. Nothing here touches ``torch.distributed``.

Vocabulary
- *Part* of a rank's local rows: ``"all"``, ``"lo"`` (first half), ``"hi"`` (second half), or in general
  ``"a:b/n"`` (a :class:`Rows`): rows ``[a*s//n, b*s//n)`` of the ``s`` local rows (row chunks of a block; ``"lo"`` is
  ``"0:1/2"``). Zigzag causal attention only ever needs halves (see :func:`block_pair`). *Heads*: ``"all"``,
  ``"h0"`` or ``"h1"`` (half of the K/V heads with their query heads), for strategies that send the two
  halves different ways.
- :class:`Compute`: rank ``rank`` attends the ``q_part`` rows of rank ``q_owner``'s queries to the ``kv_part``
  rows of rank ``kv_owner``'s keys/values; ``diag`` marks the causal diagonal block (masked lower-triangular;
  every other block is attended in full). What the rows mean is the strategy's business (Ulysses: the whole
  sequence over ``H/P`` heads).
- :class:`Message`: a payload of ``kind`` (see :mod:`tokenring.messages`) about rank ``owner``'s rows
  ``part``, from ``src`` to ``dst``. Messages of step ``t`` are posted when step ``t`` starts and overlap its
  computes; what they deliver is usable from step ``t + 1`` on (from ``due + 1`` for a message given until
  step ``due``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import gcd

import torch

from .masks import pair_table, shard_pair
from .merge import acc_dtype
from .messages import Receive
from .messages import kind as message_kind

__all__ = [
    "Rows",
    "ALL",
    "LO",
    "HI",
    "PARTS",
    "HEADS",
    "head_slice",
    "Compute",
    "Message",
    "Step",
    "Schedule",
    "Shapes",
    "block_pair",
    "part_slice",
    "part_union",
    "part_intersection",
    "covers",
    "overlaps",
    "part_rows",
    "chunk",
    "rows",
    "own_pieces",
    "all_own_pieces",
    "pairings",
    "pairing",
    "drop_empty_tail",
    "payload",
    "message_bytes",
    "relay",
    "relay_through",
    "ulysses_kv_heads",
]


@dataclass(frozen=True, eq=False, repr=False)
class Rows:
    """Rows ``[a*s//n, b*s//n)`` of a rank's ``s`` local rows, an exact fraction kept reduced. Its text is
    ``"all"``, ``"lo"``, ``"hi"`` or ``"a:b/n"``; a Rows equals (and hashes as) its text, so a part written as
    text in a schedule or a test finds the same entries."""

    a: int
    b: int
    n: int

    def __post_init__(self):
        if not 0 <= self.a < self.b <= self.n:
            raise ValueError(f"rows {self.a}:{self.b}/{self.n} are not a row range within the block")
        g = gcd(gcd(self.a, self.b), self.n)
        for name in ("a", "b", "n"):
            object.__setattr__(self, name, getattr(self, name) // g)
        text = _NAMED.get((self.a, self.b, self.n), f"{self.a}:{self.b}/{self.n}")
        object.__setattr__(self, "_text", text)  # written and hashed once: parts key the Store's dicts
        object.__setattr__(self, "_hash", hash(text))

    @staticmethod
    def of(part: "Rows | str") -> "Rows":
        """``part`` as Rows (parsing its text)."""
        return part if isinstance(part, Rows) else _parse_rows(part)

    def __str__(self) -> str:
        return self._text

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        if other is self:
            return True
        if isinstance(other, str):
            try:
                other = _parse_rows(other)
            except ValueError:
                return False
        return isinstance(other, Rows) and (self.a, self.b, self.n) == (other.a, other.b, other.n)

    def __hash__(self) -> int:
        return self._hash

    # Ordered as their text (a stable order for sorting logs and tests, mixed with text parts too).
    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __gt__(self, other) -> bool:
        return str(self) > str(other)

    def __le__(self, other) -> bool:
        return str(self) <= str(other)

    def __ge__(self, other) -> bool:
        return str(self) >= str(other)


_NAMED = {(0, 1, 1): "all", (0, 1, 2): "lo", (1, 2, 2): "hi"}
ALL, LO, HI = Rows(0, 1, 1), Rows(0, 1, 2), Rows(1, 2, 2)
PARTS = (ALL, LO, HI)
# Head halves, for strategies that split K/V heads between two directions: "h0" is the first half of the K/V
# heads together with the query heads that attend to them (GQA groups are contiguous), "h1" the second half.
HEADS = ("all", "h0", "h1")


@lru_cache(maxsize=1 << 16)
def rows(a: int, b: int, n: int) -> Rows:
    """The part naming rows ``[a*s//n, b*s//n)`` (reduced: ``rows(2, 4, 4) == "hi"``)."""
    return Rows(a, b, n)


@lru_cache(maxsize=4096)
def _parse_rows(text: str) -> Rows:
    for key, name in _NAMED.items():
        if text == name:
            return Rows(*key)
    try:
        ab, n = text.split("/")
        a, b = ab.split(":")
        a, b, n = int(a), int(b), int(n)
    except (ValueError, AttributeError):
        raise ValueError(f"unknown part {text!r}: use 'all', 'lo', 'hi' or 'a:b/n'") from None
    if not 0 <= a < b <= n:
        raise ValueError(f"part {text!r} is not a row range within the block")
    return Rows(a, b, n)


def _frac(part: "Rows | str") -> tuple[int, int, int]:
    """``part`` as ``(a, b, n)``: rows ``[a*s//n, b*s//n)``."""
    r = part if type(part) is Rows else _parse_rows(part)
    return r.a, r.b, r.n


def chunk(part: str, i: int, c: int, j: int | None = None) -> str:
    """Row chunks ``i`` up to ``j`` (default ``i + 1``) of ``c`` equal chunks of ``part``
    (``chunk("hi", 0, 2) == "2:3/4"``)."""
    a, b, n = _frac(part)
    j = i + 1 if j is None else j
    return rows(a * c + i * (b - a), a * c + j * (b - a), n * c)


def part_slice(part: str, n: int) -> slice:
    """Row slice of ``part`` within ``n`` local rows (floors: any ``n`` works, chunks differ by a row at most)."""
    a, b, m = _frac(part)
    return slice(a * n // m, b * n // m)


def part_rows(part: str, n: int) -> int:
    sl = part_slice(part, n)
    return sl.stop - sl.start


def head_slice(heads: str, n: int) -> slice:
    """Slice of ``heads`` within ``n`` heads (query or K/V heads alike)."""
    return part_slice({"all": ALL, "h0": LO, "h1": HI}[heads], n)


def part_union(a: str | None, b: str | None) -> str | None:
    """Smallest row range covering both (``None`` = nothing)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    (a0, a1, an), (b0, b1, bn) = _frac(a), _frac(b)
    n = an * bn // gcd(an, bn)
    return rows(min(a0 * (n // an), b0 * (n // bn)), max(a1 * (n // an), b1 * (n // bn)), n)


def part_intersection(a: str, b: str) -> str | None:
    """The rows in both (``None``: none, for any local length)."""
    (a0, a1, an), (b0, b1, bn) = _frac(a), _frac(b)
    n = an * bn // gcd(an, bn)
    lo, hi = max(a0 * (n // an), b0 * (n // bn)), min(a1 * (n // an), b1 * (n // bn))
    return rows(lo, hi, n) if lo < hi else None


def overlaps(a: str, b: str) -> bool:
    """Whether row ranges ``a`` and ``b`` share a row (for any local length: compared as fractions)."""
    (a0, a1, an), (b0, b1, bn) = _frac(a), _frac(b)
    return a0 * bn < b1 * an and b0 * an < a1 * bn


def covers(holder: str, part: str) -> bool:
    """Whether rows ``holder`` include rows ``part``."""
    (p0, p1, pn), (h0, h1, hn) = _frac(part), _frac(holder)
    return h0 * pn <= p0 * hn and p1 * hn <= h1 * pn  # compared over the common denominator pn * hn


@dataclass(frozen=True)
class Compute:
    rank: int
    q_owner: int
    q_part: str
    kv_owner: int
    kv_part: str
    diag: bool = False
    heads: str = "all"


@dataclass(frozen=True)
class Message:
    """A payload of ``kind`` about rank ``owner``'s rows ``part`` from ``src`` to ``dst``. ``due``: the step by
    whose end it must have arrived (``-1``: the step it is posted in). ``ready``: the step at which the receiver
    may post its receive (``-1``: when posted), so a partial coming home is expected from the moment its rows
    left; gloo starts a send only once the receive is posted (docs/DESIGN.md, "Communication engine")."""

    src: int
    dst: int
    kind: str
    owner: int
    part: str = "all"
    heads: str = "all"
    due: int = -1
    ready: int = -1

    def receive_step(self, t: int, early: bool = True) -> int:
        """The step at which its receiver posts the receive, for a message posted at step ``t``: its ``ready``
        step where the backend posts early (``early``), else ``t``."""
        return t if self.ready < 0 or not early else min(self.ready, t)


@dataclass
class Step:
    computes: list[Compute] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)


@dataclass(eq=False)  # identity hash: schedules are cached and looked up by object
class Schedule:
    """Steps of one strategy for ``P`` ranks. ``q_kind`` names the store entry a compute reads queries from
    (``"q"`` forward, ``"qgrad"`` backward: queries with dO, lse and delta)."""

    strategy: str
    P: int
    layout: str
    causal: bool
    backward: bool
    q_kind: str
    steps: list[Step]
    mask: object = None  # a tokenring.masks.Mask (documents / window) the blocks were cut for, or None
    only: int | None = None  # built for this rank's plan alone (the steps hold its computes and messages only)

    def __post_init__(self) -> None:
        # Every rank builds the same schedule, so a bad one fails here on all of them at once; the executor
        # would only notice on the ranks whose plan holds the bad message, and the others would wait for them.
        for t, st in enumerate(self.steps):
            for m in st.messages:
                if m.due >= len(self.steps) or 0 <= m.due < t or m.ready > t:
                    raise RuntimeError(
                        f"schedule {self.strategy} (P={self.P}, {self.layout}, causal={self.causal}, "
                        f"{'backward' if self.backward else 'forward'}): {m} posted at step {t} of "
                        f"{len(self.steps)} is due or ready outside them (please report it)"
                    )

    def _mine(self, r: int) -> None:
        if self.only is not None and r != self.only:
            raise ValueError(f"schedule {self.strategy} was built for rank {self.only}'s plan alone, not rank {r}'s")

    def for_rank(self, r: int) -> list[tuple[list[Compute], list[Message], list[Message]]]:
        """Per step: this rank's computes, the messages it sends and those it receives, in posting order."""
        self._mine(r)
        return [
            (
                [c for c in st.computes if c.rank == r],
                [m for m in st.messages if m.src == r],
                [m for m in st.messages if m.dst == r],
            )
            for st in self.steps
        ]

    def postings(
        self, r: int, early: bool = True
    ) -> list[tuple[list[Compute], list[tuple[Message, int, int]], list[tuple[Message, int, int]]]]:
        """What rank ``r`` does at each step: its computes, the sends it posts and the receives it posts (at a
        message's ``ready`` step when it has one and ``early``), each as ``(message, step posted by the sender,
        n)`` where ``n`` counts the earlier messages between the same two ranks posted in that step: both ends
        derive the message's tag from that pair, whenever each of them posts it."""
        self._mine(r)
        out = [([c for c in st.computes if c.rank == r], [], []) for st in self.steps]
        for t, st in enumerate(self.steps):
            seen: dict = {}
            for m in st.messages:
                n = seen[m.src, m.dst] = seen.get((m.src, m.dst), -1) + 1
                if m.src == r:
                    out[t][1].append((m, t, n))
                if m.dst == r:
                    out[m.receive_step(t, early)][2].append((m, t, n))
        return out

    def reads(self, r: int) -> dict[tuple[str, int], list[tuple[int, str, int]]]:
        """``(kind, owner)`` -> ``(step, rows, since)`` of every read on rank ``r``: a compute's queries or K/V,
        or the payload of a message it sends. ``since``: the last step before the read at which rank ``r``
        (re)filled those rows: a message of them arriving (handled at its due step) or a compute producing a
        partial of them (``-1``: from the start). A held piece is needed after step ``u`` only by reads with
        ``since <= u`` (see ``Store.release``); a read with ``since > u`` gets fresh rows, e.g. a hierarchical
        schedule that sends a block again in its next round. (Arrivals that add into what is held, dK/dV
        accumulators, refill nothing.)"""
        out: dict = {}
        fills: dict = {}  # (kind, owner) -> [(step, rows)] of refills
        made = "dq" if self.backward else "out"  # what a compute of another rank's queries produces here
        plan = self.for_rank(r)
        for t, (computes, _, recvs) in enumerate(plan):
            for m in recvs:
                if message_kind(m.kind).receive != Receive.STORE:
                    continue
                fills.setdefault((m.kind, m.owner), []).append((t if m.due < 0 else m.due, m.part))
            for c in computes:
                if c.q_owner != r:
                    fills.setdefault((made, c.q_owner), []).append((t, c.q_part))

        def since(key, t: int, part: str) -> int:
            return max((u for u, p in fills.get(key, ()) if u < t and covers(p, part)), default=-1)

        for t, (computes, sends, _) in enumerate(plan):
            for c in computes:
                for key, part in (((self.q_kind, c.q_owner), c.q_part), (("kv", c.kv_owner), c.kv_part)):
                    out.setdefault(key, []).append((t, part, since(key, t, part)))
            for m in sends:
                key = (m.kind, m.owner)
                out.setdefault(key, []).append((t, m.part, since(key, t, m.part)))
        return out

    def describe(self, sh: "Shapes | None" = None, ranks=None, spec=None) -> str:
        """A per-step, per-rank table of what each rank computes, sends and receives (with bytes when ``sh``
        is given; ``spec``: the strategy's :func:`payload`, where it differs): the plan ``tokenring explain
        --plan`` prints."""
        what = (
            f"{self.strategy} {'backward' if self.backward else 'forward'}, P={self.P}, layout={self.layout}, "
            f"causal={self.causal}"
        )
        if sh is not None:
            what += f"; B={sh.B} s={sh.s}/rank H={sh.H} Hkv={sh.Hkv} d={sh.d} {str(sh.dtype).replace('torch.', '')}"
        lines = [what]
        ranks = range(self.P) if ranks is None else ranks

        def size(m: Message) -> str:
            return f" {message_bytes(m, sh, spec) / 1e6:.3g}MB" if sh is not None else ""

        def heads(h: str) -> str:
            return "" if h == "all" else f"[{h}]"

        for t, st in enumerate(self.steps):
            lines.append(f"step {t}")
            for r in ranks:
                comp = [
                    f"Q{c.q_owner}.{c.q_part} x KV{c.kv_owner}.{c.kv_part}{heads(c.heads)}{' diag' if c.diag else ''}"
                    for c in st.computes
                    if c.rank == r
                ]
                send = [
                    f"{m.kind}({m.owner}.{m.part}){heads(m.heads)}->{m.dst}{size(m)}"
                    f"{f' by step {m.due}' if m.due > t else ''}"
                    for m in st.messages
                    if m.src == r
                ]
                recv = [f"{m.kind}({m.owner}.{m.part}){heads(m.heads)}<-{m.src}" for m in st.messages if m.dst == r]
                if comp or send or recv:
                    lines.append(
                        f"  rank {r}: compute {', '.join(comp) or '-'} | send {', '.join(send) or '-'} | "
                        f"recv {', '.join(recv) or '-'}"
                    )
        if sh is not None:
            sent = [
                sum(message_bytes(m, sh, spec) for st in self.steps for m in st.messages if m.src == r)
                for r in range(self.P)
            ]
            lines.append(f"bytes sent per rank: max {max(sent) / 1e6:.4g} MB, total {sum(sent) / 1e6:.4g} MB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def block_pair(
    q_owner: int, kv_owner: int, P: int, layout: str, causal: bool, mask=None
) -> tuple[str, str, bool] | None:
    """Which rows of ``q_owner``'s queries meet which rows of ``kv_owner``'s keys, and whether the block is the
    causal diagonal: ``(q_part, kv_part, diag)``, or ``None`` when the block is empty (never computed, never
    communicated).

    Zigzag: rank ``r`` holds chunks ``r`` and ``2P-1-r``. If the keys' owner comes earlier (``kv < q``) every
    query row sees only the keys' first chunk; if later, only the queries' second chunk sees anything, and it
    sees all of the keys. Either way an off-diagonal pair costs half a block.

    With a ``mask`` (:class:`tokenring.masks.Mask`: packed documents, a window) the parts are the exact row
    ranges that meet (``"a:b/s"``), ``None`` when no query of one rank sees a key of the other; ``diag`` then
    only marks a rank's own block (the kernels take the mask from the tokens' positions).
    """
    if mask is not None:
        hit = shard_pair(mask, P, layout, q_owner, kv_owner)
        if hit is None:
            return None
        s = mask.S // P
        return rows(hit[0].start, hit[0].stop, s), rows(hit[1].start, hit[1].stop, s), q_owner == kv_owner
    if not causal:
        return ("all", "all", False)
    if q_owner == kv_owner:
        return ("all", "all", True)
    if layout == "contiguous":
        return ("all", "all", False) if kv_owner < q_owner else None
    if layout == "zigzag":
        return ("all", "lo", False) if kv_owner < q_owner else ("hi", "all", False)
    raise ValueError(f"unknown layout {layout!r}")


def pairing(P: int, layout: str, causal: bool, mask=None, only: int | None = None):
    """``pair(q_owner, kv_owner)`` = :func:`block_pair` for this problem: what the schedule builders take, so a
    hierarchical schedule can run them on a sub-group with its own notion of which blocks meet. With a
    ``mask``, the pairs come from one :func:`tokenring.masks.pair_table` (``only``: the pairs of that rank
    alone, all its direct schedule asks for), and ``pair.table.needs`` gives them as local row ranges, for the
    relays' unions (``pair.s``: the local rows)."""
    if mask is None:
        return lambda q_owner, kv_owner: block_pair(q_owner, kv_owner, P, layout, causal, mask)

    table, s = pair_table(mask, P, layout, only), mask.S // P

    def pair(q_owner: int, kv_owner: int):
        hit = table.get(q_owner, kv_owner)
        if hit is None:
            return None
        return rows(hit[0].start, hit[0].stop, s), rows(hit[1].start, hit[1].stop, s), q_owner == kv_owner

    pair.table, pair.s = table, s
    return pair


def relay(
    owner: int, path: list[int], needs: list[str | None], kind: str, heads: str = "all"
) -> list[tuple[int, Message]]:
    """Messages that carry ``owner``'s payload hop by hop along ``path`` (``path[t]`` is visited at step
    ``t + 1``). Each hop carries the union of what the rest of the path still needs, so once only the second
    half is needed downstream only the second half travels; hops nobody downstream needs are dropped.
    Returns ``(step_posted, message)`` pairs."""
    out = []
    remaining: str | None = None
    suffix: list[str | None] = [None] * len(path)
    for i in range(len(path) - 1, -1, -1):
        remaining = part_union(remaining, needs[i])
        suffix[i] = remaining
    prev = owner
    for i, dst in enumerate(path):
        if suffix[i] is None:
            break
        out.append((i, Message(prev, dst, kind, owner, suffix[i], heads)))
        prev = dst
    return out


def relay_through(
    owner: int, path: list[int], need, kind: str, only: int, s: int, heads: str = "all"
) -> list[tuple[int, Message]]:
    """The hops of :func:`relay` that start or end at rank ``only``, from ``need = (live, lo, hi)``: whether
    rank ``x`` needs rows of ``owner``'s and which local rows ``[lo[x], hi[x])`` of ``s``
    (:meth:`tokenring.masks.PairTable.needs`). Reads the needs of ``only`` and the ranks after it alone."""
    if only == owner:
        first = 0
    elif only in path:
        first = path.index(only)
    else:
        return []
    last = first + (only != owner)  # the hop into `only` and the one out of it
    live, lo_of, hi_of = need
    lo, hi, union = None, None, {}
    for i in range(len(path) - 1, first - 1, -1):  # unions of what the rest of the path needs, from its end
        x = path[i]
        if live[x]:
            lo, hi = (lo_of[x], hi_of[x]) if lo is None else (min(lo, lo_of[x]), max(hi, hi_of[x]))
        if i <= last and lo is not None:
            union[i] = rows(lo, hi, s)
    return [
        (i, Message(owner if i == 0 else path[i - 1], path[i], kind, owner, union[i], heads))
        for i in range(first, min(last, len(path) - 1) + 1)
        if i in union
    ]


def drop_empty_tail(steps: list[Step]) -> list[Step]:
    """``steps`` without trailing steps that neither compute nor communicate. A message due at a dropped step
    is due at the last step instead: nothing after it runs meanwhile, so the receiver waits for it there (a
    two-level schedule whose last rounds a mask or a late own round leaves empty gives such dues)."""
    while steps and not steps[-1].computes and not steps[-1].messages:
        steps.pop()
    last = len(steps) - 1
    for st in steps:
        st.messages = [replace(m, due=last) if m.due > last else m for m in st.messages]
    return steps


def pairings(P: int) -> list[list[int]]:
    """Rounds in which every rank meets every other exactly once, as ``partner[r]`` per round (``r`` itself: a
    bye). Even ``P``: ``P - 1`` perfect matchings (the circle method); odd ``P``: ``P`` rounds, rank ``k``
    sitting out round ``k``. Both ends of a link work on each other's blocks in the same round, so a link's two
    directions are used together (gloo in particular moves data much faster when a pair's receive is posted
    with its send, measured on the testbed)."""
    if P % 2:
        return [[(2 * k - r) % P for r in range(P)] for k in range(P)]
    M = P - 1
    rounds = []
    for k in range(M):
        partner = [(2 * k - r) % M for r in range(M)] + [k]
        partner[k] = M
        rounds.append(partner)
    return rounds


# What a direct schedule's first visiting chunk brings and its last partial takes home, in blocks of Q's size
# (fwd pass-Q: Q out, (out, lse) back; bwd pass-Q: Q, dO (+ lse, delta) out, dQ back; pass-KV: K, V out, and in
# backward dK, dV back): the own block's compute is split between its head and its tail in this proportion.
_HEAD_TAIL = {("q", False): (1, 1), ("q", True): (2, 1), ("kv", False): (1, 0), ("kv", True): (1, 1)}


def own_pieces(
    chunks: int, P: int, mover: str = "q", backward: bool = False, triangle: bool = False
) -> list[tuple[int, int, int]]:
    """How :func:`direct_steps` cuts a rank's own block on ``P`` ranks: ``(a, b, n)`` = rows ``[a/n, b/n)``
    of its query part, one piece per step that computes it, in step order: the head (step 0), one piece per
    bye round (odd ``P``: ``chunks`` of them, ``1/(2*chunks+1)`` of the rows each), the tail (the last step;
    none when nothing goes home, forward pass-KV).

    The head runs while the first visiting chunks arrive and the tail while the last partials travel home, so
    the rest is split between them as the bytes of those transfers (:data:`_HEAD_TAIL`): halves of the
    compute for forward TokenRing, 2:1 for its backward, all to the head for forward pass-KV. Shares are of
    *compute*: on the causal diagonal (``triangle``) rows ``[0, x)`` cost ``x**2`` of the block. Cuts are
    rounded so that every piece has a row whenever the rank has 2 rows (even ``P``) or ``2*chunks+1`` rows
    (odd ``P``: the head and the tail take whole ``1/(2*chunks+1)`` cells)."""
    head, tail = _HEAD_TAIL[mover, backward]
    share = head / (head + tail)  # of the compute not spent in bye rounds
    if P % 2 == 0:
        if not tail:
            return [(0, 1, 1)]
        x = share**0.5 if triangle else share
        a = min(7, max(4, round(8 * x)))  # head >= half the rows (it holds >= half the compute) and a tail row
        return [(0, a, 8), (a, 8, 8)]
    n = 2 * chunks + 1
    cost = (lambda x: x * x) if triangle else (lambda x: x)

    def head_share(h: int) -> float:  # of head + tail compute, with the bye cells in between
        head_cost = cost(h / n)
        return head_cost / (head_cost + 1 - cost((h + chunks) / n))

    # (a tie goes to the larger head, the cut used before the split followed the bytes)
    h = chunks + 1 if not tail else min(range(chunks, 0, -1), key=lambda h: round(abs(head_share(h) - share), 9))
    return [(0, h, n)] + [(i, i + 1, n) for i in range(h, h + chunks)] + ([(h + chunks, n, n)] if tail else [])


def all_own_pieces(chunks: int, P: int, mover: str) -> list[tuple[int, int, int]]:
    """Every piece :func:`own_pieces` may cut for ``mover``, either pass, on or off the causal diagonal (what
    a length check must find non-empty)."""
    return sorted(
        {
            p
            for backward in (False, True)
            for triangle in (False, True)
            for p in own_pieces(chunks, P, mover, backward, triangle)
        }
    )


def ulysses_kv_heads(H: int, Hkv: int, P: int) -> int:
    """K/V heads Ulysses scatters: ``Hkv`` repeated the fewest times that makes it divisible by ``P``
    (``H % P == 0`` guarantees the repeat factor divides ``H // Hkv``)."""
    return Hkv * (P // gcd(Hkv, P))


@dataclass(frozen=True)
class Shapes:
    """Per-rank problem size: batch, local length, query heads, K/V heads, head dim, dtype, ranks."""

    B: int
    s: int
    H: int
    Hkv: int
    d: int
    dtype: torch.dtype
    P: int


def payload(kind: str, part: str, sh: Shapes, heads: str = "all") -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """Tensors of a message of ``kind`` (its row in :data:`tokenring.messages.KINDS`) about rows ``part`` and
    head half ``heads``: ``(shape, dtype, sequence dim)`` each; the head dim is ``3 - sequence dim`` ((B, n, h,
    d) tensors and (B, h, n) row statistics). Partial outputs travel in the input dtype, row statistics (lse,
    delta) and travelling dK/dV accumulators in the accumulator dtype."""
    spec = message_kind(kind)
    if heads != "all":
        sh = replace(sh, H=sh.H // 2, Hkv=sh.Hkv // 2)
    n = part_rows(part, sh.s)
    B, H, Hkv, d, dt, acc = sh.B, sh.H, sh.Hkv, sh.d, sh.dtype, acc_dtype(sh.dtype)
    shapes = {
        "q": ((B, n, H, d), dt, 1),
        "kv": ((B, n, Hkv, d), dt, 1),
        "stat": ((B, H, n), acc, 2),
        "kv_acc": ((B, n, Hkv, d), acc, 1),
        "uq": ((B, n, H // sh.P, d), dt, 1),
        "ukv": ((B, n, ulysses_kv_heads(H, Hkv, sh.P) // sh.P, d), dt, 1),
    }
    return [shapes[t] for t in spec.tensors]


def message_bytes(m: Message, sh: Shapes, spec=None) -> int:
    """Bytes of ``m`` (``spec``: a strategy's payload function, default :func:`payload`)."""
    total = 0
    for shape, dt, _ in (spec or payload)(m.kind, m.part, sh, m.heads):
        numel = 1
        for x in shape:
            numel *= x
        total += numel * dt.itemsize
    return total
