"""Schedules as plain data: which block each rank computes at each step and which messages travel meanwhile.
The executor and the simulator run the same objects. Vocabulary (parts, Compute, Message): docs/schedules.md.
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
    """Rows ``[a*s//n, b*s//n)`` of a rank's ``s`` local rows, reduced; equal to (and hashed as) its text."""

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
    """Row chunks ``i`` up to ``j`` (default ``i + 1``) of ``c`` equal chunks of ``part``."""
    a, b, n = _frac(part)
    j = i + 1 if j is None else j
    return rows(a * c + i * (b - a), a * c + j * (b - a), n * c)


@lru_cache(maxsize=1 << 14)
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
    """A payload of ``kind`` about rank ``owner``'s rows ``part`` from ``src`` to ``dst``; ``due`` and ``ready``:
    docs/schedules.md."""

    src: int
    dst: int
    kind: str
    owner: int
    part: str = "all"
    heads: str = "all"
    due: int = -1
    ready: int = -1

    def receive_step(self, t: int, early: bool = True) -> int:
        """The step its receiver posts the receive at, for a message posted at step ``t``."""
        return t if self.ready < 0 or not early else min(self.ready, t)


@dataclass
class Step:
    computes: list[Compute] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)


@dataclass(eq=False)  # identity hash: schedules are cached and looked up by object
class Schedule:
    """Steps of one strategy for ``P`` ranks (``q_kind``: the store entry computes read queries from)."""

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
        # checked here, on every rank alike (docs/schedules.md)
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
        """Per step: rank ``r``'s computes, sends and receives as ``(message, step posted, n)``, the pair its tag
        comes from (docs/schedules.md)."""
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
        """``(kind, owner)`` -> ``(step, rows, since)`` of every read on rank ``r``, for ``Store.release``
        (``since``: when those rows were last refilled; docs/schedules.md)."""
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
        """The per-step, per-rank table ``tokenring explain --plan`` prints (bytes when ``sh`` is given)."""
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
    """``(q_part, kv_part, diag)`` of the rows of two ranks that meet, or ``None`` for an empty block
    (docs/schedules.md, "Which blocks meet")."""
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
    """``pair(q_owner, kv_owner)`` = :func:`block_pair` for this problem, what the schedule builders take."""
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
    """``(step_posted, message)`` pairs carrying ``owner``'s payload hop by hop along ``path``, each hop only the
    rows the rest of the path needs."""
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
    """The hops of :func:`relay` that start or end at rank ``only``, from ``need = (live, lo, hi)`` per rank."""
    if only == owner:
        first = 0
    elif only in path:
        first = path.index(only)
    else:
        return []
    last = first + (only != owner)  # the hop into `only` and the one out of it
    live, lo_of, hi_of = need
    lo, hi, union = None, None, {}
    for i in range(len(path) - 1, first - 1, -1):
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
    """``steps`` without trailing empty steps; a message due at a dropped step is due at the last one."""
    while steps and not steps[-1].computes and not steps[-1].messages:
        steps.pop()
    last = len(steps) - 1
    for st in steps:
        st.messages = [replace(m, due=last) if m.due > last else m for m in st.messages]
    return steps


def pairings(P: int) -> list[list[int]]:
    """Rounds in which every rank meets every other once, as ``partner[r]`` per round (``r`` itself: a bye)."""
    if P % 2:
        return [[(2 * k - r) % P for r in range(P)] for k in range(P)]
    M = P - 1
    rounds = []
    for k in range(M):
        partner = [(2 * k - r) % M for r in range(M)] + [k]
        partner[k] = M
        rounds.append(partner)
    return rounds


# bytes in and out of a direct schedule, in Q blocks: the own block's head:tail split (docs/schedules.md)
_HEAD_TAIL = {("q", False): (1, 1), ("q", True): (2, 1), ("kv", False): (1, 0), ("kv", True): (1, 1)}


def own_pieces(
    chunks: int, P: int, mover: str = "q", backward: bool = False, triangle: bool = False
) -> list[tuple[int, int, int]]:
    """How the direct schedule cuts a rank's own block: ``(a, b, n)`` = rows ``[a/n, b/n)`` per step that
    computes it, head, byes, tail (docs/schedules.md, "A rank's own block")."""
    head, tail = _HEAD_TAIL[mover, backward]
    share = head / (head + tail)  # of the compute not spent in bye rounds
    if P % 2 == 0:
        if not tail:
            return [(0, 1, 1)]
        x = share**0.5 if triangle else share
        a = min(7, max(4, round(8 * x)))
        return [(0, a, 8), (a, 8, 8)]
    n = 2 * chunks + 1
    cost = (lambda x: x * x) if triangle else (lambda x: x)

    def head_share(h: int) -> float:  # of head + tail compute, with the bye cells in between
        head_cost = cost(h / n)
        return head_cost / (head_cost + 1 - cost((h + chunks) / n))

    h = chunks + 1 if not tail else min(range(chunks, 0, -1), key=lambda h: round(abs(head_share(h) - share), 9))
    return [(0, h, n)] + [(i, i + 1, n) for i in range(h, h + chunks)] + ([(h + chunks, n, n)] if tail else [])


def all_own_pieces(chunks: int, P: int, mover: str) -> list[tuple[int, int, int]]:
    """Every piece :func:`own_pieces` may cut for ``mover``, either pass, on or off the diagonal."""
    return sorted(
        {
            p
            for backward in (False, True)
            for triangle in (False, True)
            for p in own_pieces(chunks, P, mover, backward, triangle)
        }
    )


def ulysses_kv_heads(H: int, Hkv: int, P: int) -> int:
    """K/V heads Ulysses scatters: ``Hkv`` repeated the fewest times that makes it divisible by ``P``."""
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


def payload(
    kind: str, part: str, sh: Shapes, heads: str = "all"
) -> tuple[tuple[tuple[int, ...], torch.dtype, int], ...]:
    """``(shape, dtype, sequence dim)`` of each tensor of a message of ``kind`` about rows ``part`` (read-only)."""
    return _payload(kind, part, sh, heads)


@lru_cache(maxsize=1 << 12)  # read per message per call: the executor's hot path
def _payload(kind: str, part: str, sh: Shapes, heads: str) -> tuple:
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
        "pos": ((n,), torch.int64, 0),
    }
    return tuple(shapes[t] for t in spec.tensors)


def message_bytes(m: Message, sh: Shapes, spec=None) -> int:
    """Bytes of ``m`` (``spec``: a strategy's payload function, default :func:`payload`)."""
    total = 0
    for shape, dt, _ in (spec or payload)(m.kind, m.part, sh, m.heads):
        numel = 1
        for x in shape:
            numel *= x
        total += numel * dt.itemsize
    return total
