"""Decoding over a sequence-sharded KV cache: new tokens' queries attend every rank's cached keys, exactly; the
partials go to every rank in one all-gather (the ``replicated`` schedule, whose messages all leave at once) and
are merged in one pass over the stacked partials, the same bits on every rank (docs/internals.md, "Decoding").
"""

from __future__ import annotations

import torch

from .agreement import code, exchange, refuse_at_exchange, require_same
from .comm import Comm
from .extend import RowMask, attend_rows, check_rows
from .kernels import attention_inputs, fold_scale, softmax_scale_of
from .layouts import group_info
from .merge import acc_dtype, merge_sink_, merge_stacked
from .ops import _group_name

__all__ = ["decode_attention", "place_new", "step_bytes"]


def place_new(counts: list[int], t: int) -> list[tuple[int, int]]:
    """Which of ``t`` new tokens each rank stores: a contiguous range ``(a, b)`` per rank, emptiest ranks first."""
    P = len(counts)
    after = list(counts)
    for _ in range(t):  # water-filling: each token to the emptiest rank (ties: the lowest rank)
        r = min(range(P), key=lambda i: (after[i], i))
        after[r] += 1
    out, a = [], 0
    for r in range(P):
        n = after[r] - counts[r]
        out.append((a, a + n))
        a += n
    return out


def step_bytes(B: int, t: int, H: int, d: int, P: int, acc_bytes: int = 4) -> int:
    """Bytes each rank receives per layer and decode step (the all-gather of partials, header excluded)."""
    return (P - 1) * B * t * H * (d + 1) * acc_bytes


_WHO = "tokenring decode"


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    new: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    group=None,
    state: tuple = (),
    check: bool = True,
    log: list | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
    start: int | None = None,
    row_documents=None,
) -> torch.Tensor:
    """Attention of ``t`` new tokens' queries ``q`` (B, t, H, d), the same on every rank, to a KV cache sharded
    over ``group``; returns (B, t, H, d), identical on every rank (arguments: docs/internals.md, "Decoding")."""
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: zero columns make the head dims equal (see value_dim_apart)
        return decode_attention(
            q, k, v, new=new, softmax_scale=softmax_scale, group=group, state=state, check=check, log=log,
            sinks=sinks, window=window, positions=positions, start=start, row_documents=row_documents,
        )[..., :dv]  # fmt: skip
    rank, P = group_info(group)
    try:
        rows = tuple(tuple(int(x) for x in row) for row in row_documents) if row_documents is not None else ()
        mask = RowMask(-1 if window is None else int(window), rows=rows)
        a, b = _check_step(q, k, v, new, mask, positions, start, rank)
        q, scale = fold_scale(q, softmax_scale_of(softmax_scale, q.shape[3]))
    except ValueError as e:  # the others wait in the step's check: they raise too
        if check and P > 1 and not torch.compiler.is_compiling():
            refuse_at_exchange(e, len(_HEADER) + len(state), group, rank, P, _WHO, "the step's shapes")
        raise
    if P == 1:  # every cached row precedes every new token; queries a..b-1 see new tokens a..b-1 causally
        o, lse = attend_rows(q, 0, k, v, positions, a, b, start or 0, mask, scale)
        if sinks is not None:
            merge_sink_(o, lse, sinks)
        return o.to(q.dtype)
    if check:
        B, t, H, d = q.shape
        rows = exchange(
            [B, t, H, k.shape[2], d, code(q.dtype), *map(float, state)], group, rank, P, _WHO, "the step's shapes"
        )
        require_same(
            rows, _HEADER + [f"state[{i}]" for i in range(len(state))], rank, _WHO, _SAME_STEP, doing="decodes"
        )
    if torch.compiler.is_compiling() and mask.plain and log is None:  # one opaque node for the compiler
        out, out_lse = decode_step(q, k, v, a, b, start or 0, scale, _group_name(group))
    else:
        out, out_lse = _gathered(q, k, v, positions, a, b, start or 0, mask, scale, group, log, rank, P)
    if sinks is not None:
        merge_sink_(out, out_lse, sinks)
    return out.to(q.dtype)


def _gathered(q, k, v, positions, a: int, b: int, start: int, mask, scale: float, group, log, rank: int, P: int):
    """This rank's partial over its rows, every rank's gathered in one collective (the ``replicated`` schedule
    as one step), merged in one pass over the stacked partials: the same bits on every rank."""
    o, lse = attend_rows(q, 0, k, v, positions, a, b, start, mask, scale)
    B, t, H, d = o.shape
    comm = Comm(group, what="decode", log=log is not None, rank=rank, world=P)  # (records cost host time)
    every = comm.gather(0, torch.cat([o.reshape(B, -1), lse.reshape(B, -1)], 1))
    if log is not None:
        log.append({"bytes": comm.log[0]["bytes"], "strategy": "replicated", "devices": [comm.log[0]["device"]]})
    n = t * H * d
    return merge_stacked(every[:, :, :n].view(P, B, t, H, d), every[:, :, n:].view(P, B, H, t))


@torch.library.custom_op("tokenring::decode_step", mutates_args=())
def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: int, b: int, start: int, scale: float, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_gathered` without a window or documents, as a custom op: under ``torch.compile`` a decode step
    is one node whose host work (the all-gather's posting, no value read) runs when the graph runs; its shapes
    come from :func:`_decode_step_shapes`, so ``fullgraph=True`` traces a model's decode step whole."""
    from .ops import resolve_group

    group = resolve_group(group)
    return _gathered(q, k, v, None, a, b, start, RowMask(), scale, group, None, *group_info(group))


@decode_step.register_fake
def _decode_step_shapes(q, k, v, a, b, start, scale, group):
    B, t, H, d = q.shape
    acc = acc_dtype(q.dtype)
    return q.new_empty((B, t, H, d), dtype=acc), q.new_empty((B, H, t), dtype=acc)


_HEADER = ["batch", "new tokens", "query heads", "key/value heads", "head dim", "dtype"]
_SAME_STEP = (
    "Every rank must run the same step on the same new tokens with caches from the same prefill "
    "(tokenring.hf.prefill on every rank with the same prompt)"
)


def _check_step(q, k, v, new, mask: RowMask, positions, start, rank: int) -> tuple[int, int]:
    """This rank's new tokens ``(a, b)``, or a ValueError for rows, new tokens, a window or documents it cannot
    run."""
    check_rows(q, k, v, rank, "decode_attention")
    t, n = q.shape[1], k.shape[1]
    a, b = new if new is not None else (0, 0)
    if not (0 <= a <= b <= t) or b - a > n:
        raise ValueError(
            f"rank {rank}: new={new} must name token indices 0 <= a <= b <= t={t} stored as the "
            f"last {b - a} of this rank's {n} rows"
        )
    old = n - (b - a)
    if mask.rows and len(mask.rows) != q.shape[0]:
        raise ValueError(f"rank {rank}: row_documents has {len(mask.rows)} rows, the batch {q.shape[0]}")
    if not mask.plain and (positions is None or positions.shape != (old,) or start is None):
        raise ValueError(
            f"rank {rank}: a window or row_documents need positions=, the global positions of this rank's "
            f"{old} cached rows, and start=, the position of the step's first new token (got positions "
            f"{None if positions is None else tuple(positions.shape)}, start={start})"
        )
    return a, b
