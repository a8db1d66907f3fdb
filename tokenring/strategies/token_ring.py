"""TokenRing (pass-Q, return partials): K/V stay home, queries travel, partial results go straight home.

Two schedules (``token_ring:relay`` / ``token_ring_paper``, and ``token_ring:direct,c=C,k=K``);
``strategy="token_ring"`` runs the one the cost model predicts fastest on the topology (see
:func:`tokenring.set_topology`), decided on rank 0.

``direct`` (:func:`direct` below, ``mover="q"``): each owner sends its queries straight to every rank, in
``c`` row chunks, up to ``k`` blocks ahead, so on a full mesh all links carry queries at once; each chunk's
partial goes home one step after it is computed, and the last own rows are computed at the end, hiding the
last partial's trip.

Note [the direct schedule at P=3]
    ``tokenring explain --plan --strategy token_ring:direct,c=1,k=1 --ranks 3 --pass fwd``. Odd P: the ranks
    meet in P rounds of pairs, one rank sitting out each round (a *bye*, spent on more of its own rows).
    ``Qj.a:b/3``: rows a/3..b/3 of rank j's queries; ``out(j)``: the partial of Q_j going home. ::

        step  rank 0                    rank 1                    rank 2
        0     Q0.0:1/3 x KV0            Q1.0:1/3 x KV1            Q2.0:1/3 x KV2
              -                         q(1)->2  q(2)<-2          q(2)->1  q(1)<-1
        1     Q0.1:2/3 x KV0 (bye)      Q2 x KV1                  Q1 x KV2
              q(0)->2  q(2)<-2          -                         q(2)->0  q(0)<-0
        2     Q2 x KV0                  Q1.1:2/3 x KV1 (bye)      Q0 x KV2
              q(0)->1  q(1)<-1          out(2)->2 q(1)->0 ...     out(1)->1  out(2)<-1
        3     Q1 x KV0                  Q0 x KV1                  Q2.1:2/3 x KV2 (bye)
              out(2)->2  out(0)<-2      -                         out(0)->0  out(2)<-0
        4     Q0.2:3/3 x KV0            Q1.2:3/3 x KV1            Q2.2:3/3 x KV2
              out(1)->1  out(0)<-1      out(0)->0  out(1)<-0      -

    Every query block is computed where its keys live; every partial goes straight home over its own link;
    the last own rows (step 4) hide the last partials' trip.

``relay`` (the paper's schedule):

At step ``t`` rank ``r`` holds the queries of ``j = r + t`` (they travel ``r + 1 -> r``, one hop per step),
attends them to its own K/V, and during step ``t + 1`` sends the partial ``(out, lse)`` directly to ``j``
while it computes the next block. Queries use the link towards ``r - 1``, partials the links towards their
owners, so on a full mesh the two flows never share a link. With zigzag the path of ``Q_j`` visits first
every rank before ``j`` (needs all of ``Q_j``) and then every rank after it (needs only the second half), so
after the wrap only half of ``Q_j`` travels and only half-size partials return.

Backward: ``(Q, dO, lse, delta)`` take the same path; each visited rank accumulates dK/dV for its own K/V
locally and returns the partial dQ straight to the owner.
"""

from __future__ import annotations

import itertools

from ..schedules import (
    Compute,
    Message,
    Schedule,
    Step,
    chunk,
    drop_empty_tail,
    own_pieces,
    pairing,
    pairings,
    part_rows,
    relay,
    relay_through,
    rows,
)
from .base import RelayOrDirect

__all__ = ["TokenRing", "pass_q_steps", "direct", "direct_steps", "STRATEGY"]


def _pass_q(P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None) -> Schedule:
    steps = pass_q_steps(P, pairing(P, layout, causal, mask), backward, only)
    carry = "qgrad" if backward else "q"
    return Schedule("token_ring:relay", P, layout, causal, backward, carry, drop_empty_tail(steps), mask, only)


def pass_q_steps(P: int, pair, backward: bool, only: int | None = None) -> list[Step]:
    """The steps of the relay schedule for blocks that meet as ``pair(q_owner, kv_owner)`` says (``only``:
    just what rank ``only`` computes, sends and receives)."""
    carry, ret = ("qgrad", "dq") if backward else ("q", "out")
    steps = [Step() for _ in range(P + 1)]  # the extra step only returns the last partials
    for t in range(P):
        for r in range(P) if only is None else sorted({only, (only - t) % P}):
            j = (r + t) % P
            got = pair(j, r)
            if got is None:
                continue
            q_part, kv_part, diag = got
            if only in (None, r):
                steps[t].computes.append(Compute(r, j, q_part, r, kv_part, diag))
            if j != r:
                steps[t + 1].messages.append(Message(r, j, ret, j, q_part))
    table = getattr(pair, "table", None)
    for j in range(P):
        path = [(j - t) % P for t in range(1, P)]
        if only is not None and table is not None:
            hops = relay_through(j, path, table.needs(j, "q"), carry, only, pair.s)
        else:
            needs = [(got[0] if got else None) for got in (pair(j, r) for r in path)]
            hops = [(t, m) for t, m in relay(j, path, needs, carry) if only in (None, m.src, m.dst)]
        for t, m in hops:
            steps[t].messages.append(m)
    return steps


def _own_rows(r: int, a: int, b: int, n: int, own, causal: bool) -> list[Compute]:
    """Rank ``r``'s queries in rows ``[a/n, b/n)`` against the K/V it holds at home, ``own = pair(r, r)``.
    The causal diagonal: everything before those rows in full plus the square diagonal block, masked; any
    other block (non-causal, or a visiting K/V block of a hierarchical round): those rows of its query part
    against its K/V part."""
    if own is None:
        return []
    q_part, kv_part, diag = own
    if not diag:  # not this rank's diagonal: those rows of the block's query part against its K/V part
        return [Compute(r, r, chunk(q_part, a, n, b), r, kv_part)]
    part = rows(a, b, n)
    if not causal:  # (a mask may still cut the block: the kernels take it from the tokens' positions)
        return [Compute(r, r, part, r, "all")]
    return ([Compute(r, r, part, r, rows(0, a, n))] if a else []) + [Compute(r, r, part, r, part, True)]


def direct(
    name: str,
    P: int,
    layout: str,
    causal: bool,
    backward: bool,
    mover: str,
    chunks: int,
    lookahead: int,
    mask=None,
    only: int | None = None,
) -> Schedule:
    """Direct (mesh-native), fine-grained schedule: every block one rank lacks comes *straight from its owner*,
    cut into ``chunks`` row chunks that are computed one per step, and sent up to ``lookahead`` blocks ahead.

    Ranks meet in the rounds of :func:`pairings` (both ends of a link exchange in the same step), chunk-major:
    chunk 0 of every partner's block, then chunk 1, ..., so consecutive steps talk to different ranks over
    different links and every link carries traffic all along.

    ``mover="q"`` (TokenRing): rank ``r`` attends its partner's queries to its own K/V; each chunk's partial
    (``out`` / ``dq``) goes straight home one step after it is computed, so a call ends about one chunk after
    its last compute, not one block. ``mover="kv"`` (pass-KV as an all-gather overlapped with compute): rank
    ``r`` attends its queries to its partner's K/V; the partial merges locally, and in backward each chunk's
    dK/dV goes home.

    Per rank: step 0 computes the first rows of its own block, the last step its last rows (hiding the first
    arrivals and the last partial's trip home), and a bye round (odd ``P``) more of its own rows
    (:func:`own_pieces`). A chunk needed at step ``x`` is posted by its owner at step
    ``max(0, x - lookahead*chunks)`` and due by step ``x - 1``; a partial is posted at ``x + 1`` and due by step
    ``x + k*c`` (the receiver merges it then), so up to ``k`` blocks of partials travel at once, to different
    owners over different links.
    Memory, whatever ``P``: at most ``k`` blocks of visiting rows in flight plus the chunk being computed (each
    chunk is freed once computed), and at most ``3k`` blocks of partials: ``k`` it made travelling home, and
    ``2k`` of receive buffers for its own rows' partials, each posted when its chunk leaves (``ready``).
    """
    steps = direct_steps(
        P,
        pairing(P, layout, causal, mask, only),
        causal,
        backward,
        mover,
        chunks,
        lookahead,
        None if mask is None else mask.S // P,
        only,
    )
    q_kind = "qgrad" if backward else "q"
    return Schedule(name, P, layout, causal, backward, q_kind, drop_empty_tail(steps), mask, only)


def direct_steps(
    P: int,
    pair,
    causal: bool,
    backward: bool,
    mover: str,
    chunks: int,
    lookahead: int,
    s: int | None = None,
    only: int | None = None,
) -> list[Step]:
    """The steps of :func:`direct` for blocks that meet as ``pair(q_owner, kv_owner)`` says (``s``: the local
    length, when parts are exact row ranges that a chunk can leave empty; ``only``: just what rank ``only``
    computes, sends and receives, asking ``pair`` about that rank's pairs alone)."""
    c, k = chunks, lookahead
    if c < 1 or not 1 <= k <= max(1, P - 1):
        raise ValueError(f"chunks must be >= 1 and lookahead in 1..P-1 = {P - 1}; got chunks={c}, lookahead={k}")
    if mover not in ("q", "kv"):
        raise ValueError(f"mover must be 'q' or 'kv', got {mover!r}")
    carry = "kv" if mover == "kv" else ("qgrad" if backward else "q")
    ret = ("dq" if backward else "out") if mover == "q" else ("dkv" if backward else None)
    rounds = pairings(P)
    last = 1 + c * len(rounds)
    steps = [Step() for _ in range(last + 1)]
    # Each rank's own rows in pieces (own_pieces): the head at step 0, one per bye round (odd P: one bye
    # round per chunk sweep), the tail at the last step.
    byes: dict[int, list[Compute]] = {}
    n_byes = c if P % 2 else 0
    for r in range(P) if only is None else (only,):
        got = pair(r, r)
        pieces = own_pieces(c, P, mover, backward, triangle=causal and got is not None and got[2])
        computes = [
            [x for x in _own_rows(r, a, b, n, got, causal) if s is None or part_rows(x.q_part, s)] for a, b, n in pieces
        ]
        steps[0].computes += computes[0]
        byes[r] = computes[1 : 1 + n_byes]
        for tail in computes[1 + n_byes :]:  # none when nothing goes home (forward pass-KV)
            steps[last].computes += tail
    x = 1
    for i, partner in itertools.product(range(c), rounds):  # chunk-major
        for r in range(P) if only is None else sorted({only, partner[only]}):  # partners pair both ways
            j = partner[r]
            if j == r:
                steps[x].computes += byes[r][i]
                continue
            got = pair(j, r) if mover == "q" else pair(r, j)
            if got is None:
                continue
            q_part, kv_part, _ = got
            part = chunk(q_part if mover == "q" else kv_part, i, c)
            if s is not None and not part_rows(part, s):
                continue  # a masked block can have fewer rows than chunks
            if only is not None and r != only:
                pass  # the partner's compute: only its messages to and from `only` belong to this plan
            elif mover == "q":
                steps[x].computes.append(Compute(r, j, part, r, kv_part))
            else:
                steps[x].computes.append(Compute(r, r, q_part, j, part))
            sent = max(0, x - k * c)
            steps[sent].messages.append(Message(j, r, carry, j, part, due=x - 1))
            if ret is not None:  # expected home from the moment the chunk leaves (see Message.ready)
                steps[x + 1].messages.append(Message(r, j, ret, j, part, due=min(x + k * c, last), ready=sent))
        x += 1
    return steps


class TokenRing(RelayOrDirect):
    """``token_ring`` alone: the variant the cost model picks; ``token_ring:relay``: the paper's schedule;
    ``token_ring:direct,c=C,k=K``: the direct one."""

    family, default_mode, mover = "token_ring", "auto", "q"

    def relay_schedule(
        self, P: int, layout: str, causal: bool, backward: bool, mask=None, only: int | None = None
    ) -> Schedule:
        return _pass_q(P, layout, causal, backward, mask, only)


STRATEGY = TokenRing()
