"""The direct (mesh-native) schedule builder, for TokenRing (``mover="q"``) and pass-KV (``mover="kv"``):
docs/schedules.md, "The direct schedule".
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
    """Rank ``r``'s queries in rows ``[a/n, b/n)`` against the K/V it holds at home, ``own = pair(r, r)``."""
    if own is None:
        return []
    q_part, kv_part, diag = own
    if not diag:
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
    """Direct schedule: every block a rank lacks comes straight from its owner in ``chunks`` row chunks, sent up
    to ``lookahead`` blocks ahead (docs/schedules.md, "The direct schedule")."""
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


def _own_blocks(steps: list[Step], P: int, pair, causal, backward, mover, c: int, s, only) -> dict:
    """Each rank's own rows in pieces (:func:`own_pieces`): the head at step 0, the tail at the last step; returns
    the pieces for the bye rounds, per rank."""
    byes: dict[int, list[list[Compute]]] = {}
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
            steps[-1].computes += tail
    return byes


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
    """The steps of :func:`direct` for blocks that meet as ``pair`` says (``s``: the local length, when a chunk
    can be empty; ``only``: that rank's part alone)."""
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
    byes = _own_blocks(steps, P, pair, causal, backward, mover, c, s, only)
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
