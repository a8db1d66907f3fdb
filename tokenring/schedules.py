"""Schedules as plain data: which block each rank computes at each step and which messages travel meanwhile.

A strategy is a :class:`Schedule`. The executor (``executor.py``) runs it on real tensors over
``torch.distributed``; the simulator runs the very same object on a topology model, so predictions and
reality use one description. Nothing here touches ``torch.distributed``.

Vocabulary
- *Part* of a rank's local rows: ``"all"``, ``"lo"`` (first half) or ``"hi"`` (second half). Zigzag causal
  attention only ever needs halves (see :func:`block_pair`). *Heads*: ``"all"``, ``"h0"`` or ``"h1"`` (half of
  the K/V heads with their query heads), for strategies that send the two halves different ways.
- :class:`Compute`: rank ``rank`` attends the ``q_part`` rows of rank ``q_owner``'s queries to the ``kv_part``
  rows of rank ``kv_owner``'s keys/values (``scope="heads"``: Ulysses' full-sequence, ``H/P``-head block).
- :class:`Message`: a payload of ``kind`` (see :func:`payload`) about rank ``owner``'s rows ``part``, from
  ``src`` to ``dst``. Messages of step ``t`` are posted when step ``t`` starts and overlap its computes; what
  they deliver is usable from step ``t + 1`` on.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import gcd

import torch

from .merge import acc_dtype

__all__ = ["PARTS", "HEADS", "head_slice", "Compute", "Message", "Step", "Schedule", "Shapes", "block_pair", "part_slice",
           "part_union", "payload", "message_bytes", "relay", "ulysses_kv_heads"]

PARTS = ("all", "lo", "hi")
# Head halves, for strategies that split K/V heads between two directions: "h0" is the first half of the K/V
# heads together with the query heads that attend to them (GQA groups are contiguous), "h1" the second half.
HEADS = ("all", "h0", "h1")


def part_slice(part: str, n: int) -> slice:
    """Row slice of ``part`` within ``n`` local rows (``n`` is even whenever a half is used)."""
    if part == "all":
        return slice(0, n)
    if part == "lo":
        return slice(0, n // 2)
    if part == "hi":
        return slice(n // 2, n)
    raise ValueError(f"unknown part {part!r}")


def head_slice(heads: str, n: int) -> slice:
    """Slice of ``heads`` within ``n`` heads (query or K/V heads alike)."""
    return part_slice({"all": "all", "h0": "lo", "h1": "hi"}[heads], n)


def part_union(a: str | None, b: str | None) -> str | None:
    """Smallest part covering both (``None`` = nothing)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    return "all"


def part_within(part: str, holder: str) -> str:
    """``part`` expressed relative to rows stored as ``holder`` (``"all"`` when they coincide)."""
    if holder == part:
        return "all"
    if holder == "all":
        return part
    raise ValueError(f"rows {part!r} requested from a buffer that only holds {holder!r}")


@dataclass(frozen=True)
class Compute:
    rank: int
    q_owner: int
    q_part: str
    kv_owner: int
    kv_part: str
    causal: bool
    scope: str = "block"  # "block": local rows; "heads": Ulysses' full sequence over H/P heads
    heads: str = "all"


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    kind: str
    owner: int
    part: str = "all"
    heads: str = "all"


@dataclass
class Step:
    computes: list[Compute] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)


@dataclass
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

    def for_rank(self, r: int) -> list[tuple[list[Compute], list[Message], list[Message]]]:
        """Per step: this rank's computes, the messages it sends and those it receives, in posting order."""
        return [([c for c in st.computes if c.rank == r],
                 [m for m in st.messages if m.src == r],
                 [m for m in st.messages if m.dst == r]) for st in self.steps]


def block_pair(q_owner: int, kv_owner: int, P: int, layout: str, causal: bool) -> tuple[str, str, bool] | None:
    """Which rows of ``q_owner``'s queries meet which rows of ``kv_owner``'s keys, and whether the block is the
    causal diagonal: ``(q_part, kv_part, causal)``, or ``None`` when the block is empty (never computed, never
    communicated).

    Zigzag: rank ``r`` holds chunks ``r`` and ``2P-1-r``. If the keys' owner comes earlier (``kv < q``) every
    query row sees only the keys' first chunk; if later, only the queries' second chunk sees anything, and it
    sees all of the keys. Either way an off-diagonal pair costs half a block.
    """
    if not causal:
        return ("all", "all", False)
    if q_owner == kv_owner:
        return ("all", "all", True)
    if layout == "contiguous":
        return ("all", "all", False) if kv_owner < q_owner else None
    if layout == "zigzag":
        return ("all", "lo", False) if kv_owner < q_owner else ("hi", "all", False)
    raise ValueError(f"unknown layout {layout!r}")


def relay(owner: int, path: list[int], needs: list[str | None], kind: str,
          heads: str = "all") -> list[tuple[int, Message]]:
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
    """Tensors of a message: ``(shape, dtype, sequence dim)`` each; the head dim is ``3 - sequence dim``
    ((B, n, h, d) tensors and (B, h, n) row statistics). Partial outputs travel in the input dtype, row
    statistics (lse, delta) and travelling dK/dV accumulators in the accumulator dtype."""
    if heads != "all":
        sh = replace(sh, H=sh.H // 2, Hkv=sh.Hkv // 2)
    n = part_slice(part, sh.s).stop - part_slice(part, sh.s).start
    B, H, Hkv, d, dt, acc = sh.B, sh.H, sh.Hkv, sh.d, sh.dtype, acc_dtype(sh.dtype)
    rows_q, rows_kv, stat = ((B, n, H, d), dt, 1), ((B, n, Hkv, d), dt, 1), ((B, H, n), acc, 2)
    if kind in ("q", "dq"):
        return [rows_q]
    if kind == "kv":
        return [rows_kv, rows_kv]
    if kind == "out":
        return [rows_q, stat]
    if kind == "qgrad":  # queries, dO, lse, delta
        return [rows_q, rows_q, stat, stat]
    if kind == "dkv":
        return [((B, n, Hkv, d), acc, 1)] * 2
    hq, hk = H // sh.P, ulysses_kv_heads(H, Hkv, sh.P) // sh.P
    uq, ukv = ((B, n, hq, d), dt, 1), ((B, n, hk, d), dt, 1)
    if kind == "u_qkv":
        return [uq, ukv, ukv]
    if kind in ("u_out", "u_dout"):
        return [uq]
    if kind == "u_grad":
        return [uq, ukv, ukv]
    raise ValueError(f"unknown message kind {kind!r}")


def message_bytes(m: Message, sh: Shapes) -> int:
    total = 0
    for shape, dt, _ in payload(m.kind, m.part, sh, m.heads):
        numel = 1
        for x in shape:
            numel *= x
        total += numel * dt.itemsize
    return total
