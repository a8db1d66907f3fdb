"""The direct (mesh-native) schedule builder: every block a rank lacks comes straight from its owner, in row
chunks, with partials going straight home. TokenRing runs it with ``mover="q"`` (``token_ring:direct``), the
pass-KV families with ``mover="kv"`` (``ring:direct``); the two-level strategies reuse :func:`direct_steps`.
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
    rows,
)

__all__ = ["direct", "direct_steps"]


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
