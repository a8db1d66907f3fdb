"""Decoding over a sequence-sharded KV cache: new tokens' queries attend every rank's cached keys, exactly.

After a sharded prefill each rank keeps its own rows of every layer's K/V; nothing is gathered. A decode step
runs the model on the same ``t`` new tokens on every rank (they are tiny), so every rank has their queries.
Each rank attends them to the rows it holds (old rows in full; the new tokens it stores causally among
themselves) and the partials ``(out, lse)`` are merged exactly through their log-sum-exp::

    rank r:   (o_r, lse_r) = attention(Q_new, K/V rows held by r)
    all ranks: all-gather (o_r, lse_r) over r, merge in rank order  ->  identical output bits everywhere

Every rank needs the output (the rest of the model runs replicated on the new tokens), so the partials go to
every rank: an all-gather of ``B*t*H*(d+1)`` accumulator-dtype numbers per rank and layer, i.e. each rank
receives ``(P-1) * B*t*H*(d+1) * 4`` bytes per layer and step (float32 accumulators), whatever the cache length.

Where new tokens' K/V go (:func:`place_new`): contiguous runs of the step's tokens to the ranks holding the
fewest cached rows, so shards stay within one token of balanced; the order of cached rows never matters for
attention to later tokens (every cached token precedes every new one), only the causal order among one
step's new tokens, which the tiles keep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .agreement import code, exchange, require_same
from .comm import wait_collective
from .device import collective_device
from .extend import RowMask, attend_rows, check_rows
from .kernels import attention_inputs, fold_scale, softmax_scale_of
from .layouts import group_info
from .merge import merge_, merge_sink_, new_accumulator

__all__ = ["decode_attention", "place_new", "step_bytes"]


def place_new(counts: list[int], t: int) -> list[tuple[int, int]]:
    """Which of ``t`` new tokens each rank stores, given the rows ``counts[r]`` each rank holds: a contiguous
    range ``(a, b)`` of the step's token indices per rank (empty: ``a == b``), filling the emptiest ranks first
    and keeping the tokens' order across ranks. The same answer on every rank."""
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
) -> torch.Tensor:
    """Attention of ``t`` new tokens' queries to a KV cache sharded over the ranks of ``group``.

    ``q``: (B, t, H, d), the same on every rank. ``k``, ``v``: (B, n, Hkv, d), the cache rows this rank holds;
    if it stores some of this step's new tokens, they are its last rows and ``new = (a, b)`` says which (token
    indices ``a..b-1`` of the step; they see each other causally, every earlier row in full). Returns
    (B, t, H, d) in ``q.dtype``, identical on every rank. ``state``: numbers that must agree across ranks
    (e.g. the cache's global length and layer), checked with the shapes before any partial travels: a
    mismatch is a ``ValueError`` on every rank. ``check=False`` skips that exchange (one collective instead of
    two) when an earlier call of the same step already checked, e.g. every layer after the first.
    ``log``: receives ``{"bytes": received}`` per call. ``sinks``: (H,) attention-sink logits (gpt-oss), merged
    into the finished rows. ``window``: a query sees keys at most ``window`` positions back (transformers'
    sliding window ``W`` is ``window=W - 1``); it needs ``positions``, the global positions of this rank's
    cached rows, and ``start``, the global position of the step's first query."""
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: zero columns make the head dims equal (see value_dim_apart)
        return decode_attention(
            q, k, v, new=new, softmax_scale=softmax_scale, group=group, state=state, check=check, log=log,
            sinks=sinks, window=window, positions=positions, start=start,
        )[..., :dv]  # fmt: skip
    rank, P = group_info(group)
    check_rows(q, k, v, rank, "decode_attention")
    B, t, H, d = q.shape
    n = k.shape[1]
    a, b = new if new is not None else (0, 0)
    if not (0 <= a <= b <= t) or b - a > n:
        raise ValueError(
            f"rank {rank}: new={new} must name token indices 0 <= a <= b <= t={t} stored as the "
            f"last {b - a} of this rank's {n} rows"
        )
    q, scale = fold_scale(q, softmax_scale_of(softmax_scale, d))
    old = n - (b - a)
    mask = RowMask(-1 if window is None else int(window))
    if window is not None and (positions is None or positions.shape != (old,) or start is None):
        raise ValueError(
            f"rank {rank}: a window needs positions=, the global positions of this rank's {old} cached rows, and "
            f"start=, the position of the step's first new token (got positions "
            f"{None if positions is None else tuple(positions.shape)}, start={start})"
        )
    # every cached row precedes every new token; new tokens a..b-1 stored here: queries a..b-1 see them
    # causally, later queries in full
    o, lse = attend_rows(q, 0, k, v, positions, a, b, start or 0, mask, scale)
    if P == 1:
        if sinks is not None:
            merge_sink_(o, lse, sinks)
        return o.to(q.dtype)
    device = collective_device(group)
    if check:
        rows = exchange(
            [B, t, H, k.shape[2], d, code(q.dtype), *map(float, state)], group, rank, P, _WHO, "the step's shapes"
        )
        names = ["batch", "new tokens", "query heads", "key/value heads", "head dim", "dtype"]
        require_same(
            rows,
            names + [f"state[{i}]" for i in range(len(state))],
            rank,
            _WHO,
            "Every rank must run the same step on the same new tokens with caches from the same prefill "
            "(tokenring.hf.prefill on every rank with the same prompt)",
            doing="decodes",
        )
    flat = torch.cat([o.reshape(-1), lse.reshape(-1)]).to(device)
    parts = [torch.empty_like(flat) for _ in range(P)]
    work = dist.all_gather(parts, flat, group=group, async_op=True)
    _wait(work, rank, "the partial outputs", group)
    if log is not None:
        log.append({"bytes": (P - 1) * flat.numel() * flat.element_size()})
    out, out_lse = new_accumulator(B, t, H, d, q.dtype, q.device)
    for part in parts:  # rank order: the same bits on every rank
        part = part.to(q.device)
        merge_(out, out_lse, part[: o.numel()].view_as(o), part[o.numel() :].view_as(lse))
    if sinks is not None:
        merge_sink_(out, out_lse, sinks)
    return out.to(q.dtype)


def _wait(work, rank: int, what: str, group) -> None:
    wait_collective(
        work, group, f"tokenring decode (rank {rank}): exchanging {what}", "a rank died or is not decoding this step"
    )
