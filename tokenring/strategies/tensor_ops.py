"""The tensor operations of a strategy's ``Ops`` (:class:`TensorOps`): what :mod:`tokenring.program` records
once per signature and replays, kept apart from the decisions in :mod:`tokenring.strategies.base` (which rows,
which stored piece, merge or copy) that choose them. A replayed call goes from the program straight here and on
to the kernels.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..comm import buffers
from ..kernels import block_backward, block_forward, tiled_backward, tiled_forward
from ..masks import block_tiles
from ..merge import acc_dtype, join, merge_, merge_seen_
from ..schedules import Compute, part_slice

__all__ = ["Merge", "TensorOps", "merge_into", "row_delta"]


def _repeat_heads(t: torch.Tensor, g: int) -> torch.Tensor:
    return t.repeat_interleave(g, dim=2)


class Merge(Enum):
    """How a partial joins an accumulator: ``ANY`` rows (some may have seen no key), rows that all ``SEEN`` a key
    (fewer ops), or a ``COPY`` into rows nothing was merged into yet, every row seen: the merge's result bit for
    bit."""

    ANY = "any"
    SEEN = "seen"
    COPY = "copy"


def merge_into(how: Merge, acc_o, acc_lse, o, lse) -> None:
    """Merge a partial into accumulator views (``how``: :class:`Merge`)."""
    if how is Merge.COPY:
        acc_o.copy_(o)
        acc_lse.copy_(lse)
    elif how is Merge.SEEN:
        merge_seen_(acc_o, acc_lse, o, lse)
    else:
        merge_(acc_o, acc_lse, o, lse)


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` as (B, H, n) in the accumulator dtype (flash-attention's D)."""
    acc = acc_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


class TensorOps:
    """The tensor operations of the ``Ops`` (:class:`tokenring.strategies.base._OpsBase`), over its shapes
    ``sh``, configuration ``cfg`` and ``device``."""

    def expand(self, t, g: int):
        return _repeat_heads(t, g)

    def zeros(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def add_(self, dst, src) -> None:
        dst.add_(src)

    def cast(self, t, dtype):
        return t.to(dtype)

    def fold_heads(self, t, g: int):
        """Gradients of K/V heads repeated ``g`` times, summed back onto each K/V head."""
        return t.unflatten(2, (-1, g)).sum(3)

    merge_into = staticmethod(merge_into)
    join = staticmethod(join)  # (a partial of one dtype travels home joined)
    row_delta = staticmethod(row_delta)

    # moving rows and heads between layouts (USP's all-to-alls)
    def cat(self, dim: int, *ts):
        return torch.cat(ts, dim)

    def contiguous(self, t):
        return t.contiguous()

    def take_rows(self, t, index):
        """Rows ``index`` (dim 1) of ``t``, in that order."""
        return t.index_select(1, index)

    def head_groups(self, n: int, *ts):
        """Tensors (B, s, n * h, ...) cut into their ``n`` head groups, as one (n, ...) tensor whose row ``j``
        holds group ``j`` of each tensor, flattened, end to end (one copy per tensor)."""
        rows = [t.unflatten(2, (n, -1)).movedim(2, 0).reshape(n, -1) for t in ts]
        return rows[0] if len(rows) == 1 else torch.cat(rows, 1)

    def adopt(self, o, lse, dtype):
        """An accumulator for inputs of ``dtype`` made from a first partial over every row and head: copies in
        the accumulator dtype, laid out as :func:`tokenring.merge.new_accumulator`'s (what merging the partial
        into an empty one gives, bit for bit, without making the empty one)."""
        acc = acc_dtype(dtype)
        return (
            o.to(acc, memory_format=torch.contiguous_format, copy=True),
            lse.to(acc, memory_format=torch.contiguous_format, copy=True),
        )

    def alloc(self, specs) -> list[torch.Tensor]:
        return buffers(specs, self.device)

    def rows(self, part: str) -> slice:
        return part_slice(part, self.sh.s)

    # The local kernels, as methods so that a benchmark can swap them out (communication-only runs).
    def block_forward(self, q, k, v, diag: bool):
        return block_forward(q, k, v, diag, self.cfg.scale)

    def block_backward(self, dout, q, k, v, lse, delta, diag: bool, out=None):
        return block_backward(dout, q, k, v, lse, delta, diag, self.cfg.scale, self.cfg.hooks.backward_kernel, out=out)

    def tiles(self, c: Compute):
        """A masked compute's tiles and the function that builds a tile's mask (:mod:`tokenring.masks`)."""
        cfg = self.cfg
        return block_tiles(
            cfg.mask, cfg.P, cfg.layout, c.q_owner, self.rows(c.q_part), c.kv_owner, self.rows(c.kv_part), self.device
        )

    def attend(self, c: Compute, q, k, v):
        """Forward of compute ``c``: the whole block, or its tiles under a mask."""
        if self.cfg.mask is None:
            return self.block_forward(q, k, v, c.diag)
        return tiled_forward(q, k, v, *self.tiles(c), self.cfg.scale)

    def attend_backward(self, c: Compute, dout, q, k, v, lse, delta, out=None):
        """Backward of compute ``c``; ``out``: the final output of those query rows, if at hand."""
        if self.cfg.mask is None:
            return self.block_backward(dout, q, k, v, lse, delta, c.diag, out)
        return tiled_backward(
            dout, q, k, v, lse, delta, *self.tiles(c), self.cfg.scale, self.cfg.hooks.backward_kernel, out=out
        )
