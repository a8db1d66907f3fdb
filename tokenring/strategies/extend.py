"""The plan of an extend step over a sequence-sharded KV cache (:mod:`tokenring.extend` runs it,
:mod:`tokenring.sim.extend` costs it): what every rank holds (:class:`Shards`), the schedules' names, which new
tokens each rank takes, how visitors' queries are batched, and the bytes each schedule moves.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STRATEGIES", "BATCH_ROWS", "Shards", "split_new", "extend_bytes", "batches"]


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


def batches(order: list[int], sh: Shards) -> list[list[int]]:
    """Consecutive ranks of ``order`` whose queries are attended together, at least :data:`BATCH_ROWS` query rows
    per group: one kernel call over the cached rows for the group instead of one per rank."""
    groups, cur, rows = [], [], 0
    for j in order:
        cur.append(j)
        rows += sh.t(j)
        if rows >= BATCH_ROWS:
            groups.append(cur)
            cur, rows = [], 0
    return groups + [cur] if cur else groups
