"""The schedules of inference over a sequence-sharded KV cache, as :class:`~tokenring.schedules.Schedule` data
that the executor runs (:mod:`tokenring.extend`, :mod:`tokenring.decode`) and the simulator costs
(:mod:`tokenring.sim.extend`): what every rank holds (:class:`Shards`), which ranks' rows meet (:func:`sees`),
the five schedules (:data:`SCHEDULES`), which new tokens each rank takes, how visitors' queries are batched, and
the bytes each schedule moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..schedules import Compute, Message, Schedule, Step, drop_empty_tail, relay

__all__ = [
    "STRATEGIES",
    "BATCH_ROWS",
    "Shards",
    "split_new",
    "extend_bytes",
    "batches",
    "sees",
    "schedule",
    "decode_schedule",
    "SCHEDULES",
]


STRATEGIES = ("pass_q", "pass_q_relay", "pass_kv", "ulysses")

BATCH_ROWS = 2048  # pass_q attends visitors' queries together until a kernel call has this many query rows


@dataclass(frozen=True)
class Shards:
    """What every rank holds for one step: ``rows[j]`` K/V rows (cached, then its new ones) and new tokens
    ``new[j] = (a_j, b_j)`` (token indices of the step; rank j's queries and its last ``b_j - a_j`` rows)."""

    rows: tuple[int, ...]
    new: tuple[tuple[int, int], ...]

    @property
    def P(self) -> int:
        return len(self.rows)

    @property
    def T(self) -> int:
        return sum(b - a for a, b in self.new)

    def t(self, j: int) -> int:
        return self.new[j][1] - self.new[j][0]

    def cached(self, j: int) -> int:
        return self.rows[j] - self.t(j)

    @property
    def start(self) -> int:
        """Global position of the step's first new token: every cached row comes before it."""
        return sum(self.cached(j) for j in range(self.P))

    def problem(self) -> str | None:
        """Why these shards do not describe one step (``None``: they do)."""
        spans = sorted(self.new)
        if any(a < 0 or b < a for a, b in spans) or any(x[1] != y[0] for x, y in zip(spans, spans[1:])):
            return f"the ranks' new-token ranges {list(self.new)} do not tile 0..T-1 without gaps or overlaps"
        if spans and spans[0][0] != 0:
            return f"the ranks' new-token ranges {list(self.new)} do not start at token 0"
        bad = [j for j in range(self.P) if self.cached(j) < 0]
        if bad:
            return f"rank(s) {bad} hold fewer rows than their new tokens (each rank stores its new tokens' K/V last)"
        return None


def split_new(counts: list[int], T: int) -> list[tuple[int, int]]:
    """Which of ``T`` new tokens each rank computes and stores: contiguous ranges in rank order, the remainder
    to the ranks holding the fewest rows."""
    P = len(counts)
    extra = set(sorted(range(P), key=lambda r: (counts[r], r))[: T % P])
    out, a = [], 0
    for r in range(P):
        n = T // P + (r in extra)
        out.append((a, a + n))
        a += n
    return out


def extend_bytes(strategy: str, shards: Shards, B: int, H: int, Hkv: int, d: int, itemsize: int, rank: int = 0) -> int:
    """Bytes rank ``rank`` receives in one layer's call (payloads only; positions, when a mask needs them, and
    the shape check excluded): what :class:`tokenring.comm.Comm` logs, as a formula."""
    P, acc = shards.P, 4 if itemsize < 8 else 8
    others = [j for j in range(P) if j != rank]
    if strategy == "pass_q":
        return (
            sum(B * shards.t(j) * H * d * itemsize for j in others) + (P - 1) * B * shards.t(rank) * H * (d + 1) * acc
        )
    if strategy == "pass_q_relay":
        return (
            sum(B * shards.t((rank + i) % P) * H * d * itemsize for i in range(1, P))
            + (P - 1) * B * shards.t(rank) * H * (d + 1) * acc
        )
    if strategy == "pass_kv":
        return sum(2 * B * shards.rows[j] * Hkv * d * itemsize for j in others)
    if strategy == "ulysses":
        h, hk = H // P, Hkv // P
        return (
            sum(B * (shards.t(j) * h + 2 * shards.rows[j] * hk) * d * itemsize for j in others)
            + (P - 1) * B * shards.t(rank) * h * d * itemsize
        )
    raise ValueError(f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or 'auto'")


def batches(order: list[int], sh: Shards, per: int | None = None) -> list[list[int]]:
    """Consecutive ranks of ``order`` whose queries are attended together, at least ``per`` (default
    :data:`BATCH_ROWS`) query rows per group: one kernel call over the cached rows for the group, not one per rank."""
    per = BATCH_ROWS if per is None else per
    groups, cur, rows = [], [], 0
    for j in order:
        cur.append(j)
        rows += sh.t(j)
        if rows >= per:
            groups.append(cur)
            cur, rows = [], 0
    return groups + [cur] if cur else groups


@lru_cache(maxsize=256)
def sees(shards: Shards, ranges: tuple | None = None, left: int = -1) -> tuple[tuple[bool, ...], ...]:
    """``sees[qj][kj]``: whether rank ``qj``'s queries see any row of rank ``kj`` (``ranges[j]``: rank j's cached
    positions' (min, max), needed with a window of ``left`` tokens)."""

    def meets(qj: int, kj: int) -> bool:
        a, b = shards.new[qj]
        if a == b:
            return False
        ka, kb = shards.new[kj]
        sees_new = kb > ka and ka < b
        if not shards.cached(kj):
            return sees_new
        if left >= 0 and ranges is not None and ranges[kj][1] < shards.start + a - left:
            return sees_new  # every cached row of kj is out of the window of qj's first query
        return True

    return tuple(tuple(meets(qj, kj) for kj in range(shards.P)) for qj in range(shards.P))


def _at(r: int, q_owner: int, kv_owner: int) -> Compute:
    return Compute(r, q_owner, "all", kv_owner, "all")


def _pass_q(sh: Shards, see, positions: bool, per: int) -> list[Step]:
    """Direct: queries straight to every rank that holds rows they see, own rows first while they travel, then
    visitors in :func:`batches` (one step each), each batch's partials straight home the step after."""
    P = sh.P
    groups = [batches([(r + i) % P for i in range(1, P) if see[(r + i) % P][r]], sh, per) for r in range(P)]
    last = 1 + max(len(g) for g in groups)  # the step that posts the last batch's partials
    steps = [Step() for _ in range(last + 1)]
    for r in range(P):
        if see[r][r]:
            steps[0].computes.append(_at(r, r, r))
        for k, group in enumerate(groups[r]):
            for j in group:  # j's queries: due before the step that attends them; partials home after it
                steps[0].messages.append(Message(j, r, "q", j, due=k, ready=0))
                steps[k + 1].computes.append(_at(r, j, r))
                steps[k + 2].messages.append(Message(r, j, "out", j, due=last, ready=0))
    return steps


def _pass_q_relay(sh: Shards, see, positions: bool, per: int = 0) -> list[Step]:
    """The paper's schedule: queries travel ``r+1 -> r`` (as far as a rank further on sees them), rank r attends
    rank ``r+i``'s at step i, and partials go straight home the step after."""
    P = sh.P
    steps = [Step() for _ in range(P + 1)]
    for j in range(P):
        path = [(j - i) % P for i in range(1, P)]
        for t, m in relay(j, path, ["all" if see[j][x] else None for x in path], "q"):
            steps[t].messages.append(Message(m.src, m.dst, "q", j, due=t))
        for i, x in enumerate([j] + path):
            if see[j][x]:
                steps[i].computes.append(_at(x, j, x))
                if x != j:
                    steps[i + 1].messages.append(Message(x, j, "out", j, due=P, ready=0))
    return steps


def _pass_kv(sh: Shards, see, positions: bool, per: int = 0) -> list[Step]:
    """Ring attention: rows travel ``r -> r+1`` (as far as a rank further on sees them) while each rank attends
    its queries to the rows it holds; cached positions travel with them when a mask needs them."""
    P = sh.P
    steps = [Step() for _ in range(P)]
    for o in range(P):
        path = [(o + i) % P for i in range(1, P)]
        for t, m in relay(o, path, ["all" if see[x][o] else None for x in path], "kv"):
            steps[t].messages.append(Message(m.src, m.dst, "kv", o, due=t))
            if positions and sh.cached(o):
                steps[t].messages.append(Message(m.src, m.dst, "pos", o, due=t))
        for i, x in enumerate([o] + path):
            if see[x][o]:
                steps[i].computes.append(_at(x, x, o))
    return steps


def _ulysses(sh: Shards, see, positions: bool, per: int = 0) -> list[Step]:
    """All-to-all by head groups (rank r takes head group r of every rank's rows), attend, and all-to-all each
    rank's rows of the output back."""
    P = sh.P
    steps = [Step() for _ in range(3)]
    for r in range(P):
        steps[1].computes += [_at(r, r, j) for j in range(P)]
        for j in range(P):
            if j != r:
                steps[0].messages.append(Message(r, j, "u_qkv", r, due=0))
                if positions and sh.cached(r):
                    steps[0].messages.append(Message(r, j, "pos", r, due=0))
                steps[2].messages.append(Message(r, j, "u_out", j, due=2))
    return steps


def _replicated(sh: Shards, see, positions: bool, per: int = 0) -> list[Step]:
    """Decode: every rank holds every query; each attends its own rows and sends the partial to every rank."""
    P = sh.P
    steps = [Step(), Step()]
    for r in range(P):
        steps[0].computes.append(_at(r, r, r))
        steps[1].messages += [Message(r, j, "out", r, due=1) for j in range(P) if j != r]
    return steps


SCHEDULES = {
    "pass_q": _pass_q,
    "pass_q_relay": _pass_q_relay,
    "pass_kv": _pass_kv,
    "ulysses": _ulysses,
    "replicated": _replicated,
}


@lru_cache(maxsize=64)
def decode_schedule(P: int) -> Schedule:
    """The ``replicated`` schedule on ``P`` ranks: a decode step (every rank holds every query)."""
    steps = _replicated(Shards((0,) * P, ((0, 0),) * P), (), False)  # the steps need P alone
    return Schedule("replicated", P, "extend", True, False, "q", steps)


def schedule(strategy: str, shards: Shards, see: tuple | None = None, positions: bool = False) -> Schedule:
    """The :class:`Schedule` of ``strategy`` for these shards (``see``: :func:`sees`, default every pair that
    meets without a window; ``positions``: cached positions travel with K/V, for a window or documents)."""
    if strategy not in SCHEDULES:
        raise ValueError(f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or 'auto'")
    return _schedule(strategy, shards, sees(shards) if see is None else see, positions, BATCH_ROWS)


@lru_cache(maxsize=256)
def _schedule(strategy: str, shards: Shards, see: tuple, positions: bool, per: int) -> Schedule:
    steps = drop_empty_tail(SCHEDULES[strategy](shards, see, positions, per))
    return Schedule(strategy, shards.P, "extend", True, False, "q", steps)
