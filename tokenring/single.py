"""One rank with documents, a window or attention sinks: the tiles of the whole sequence, no communication
(no (S, S) mask is ever built). Not a registry strategy: :func:`tokenring.attention` runs it when ``P == 1``
and PyTorch's own attention cannot express the call."""

from __future__ import annotations

from .kernels import block_backward, block_forward, needs_equal_heads, tiled_backward, tiled_forward
from .masks import whole_tiles
from .merge import merge_sink_, sink_grad
from .strategies.base import Strategy, row_delta

__all__ = ["SINGLE"]


class Single(Strategy):
    name = "single"

    def _repeat(self, q, k) -> int:
        return q.shape[2] // k.shape[2] if needs_equal_heads(q) else 1

    def _tiles(self, cfg, device):
        return whole_tiles(cfg.mask, device) if cfg.mask is not None else None

    def forward(self, q, k, v, cfg):
        g = self._repeat(q, k)
        kk, vv = (k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)) if g > 1 else (k, v)
        tiles = self._tiles(cfg, q.device)
        if tiles is None:
            o, lse = block_forward(q, kk, vv, cfg.causal, cfg.scale)
        else:
            o, lse = tiled_forward(q, kk, vv, *tiles, cfg.scale)
        if cfg.sinks is not None:
            o = o.to(lse.dtype)
            merge_sink_(o, lse, cfg.sinks)
        out = o.to(q.dtype)
        return out, (q, k, v, out, lse.contiguous())  # (kept for backward, and an op's output: contiguous)

    def backward(self, dout, saved, cfg):
        q, k, v, out, lse = saved
        g = self._repeat(q, k)
        kk, vv = (k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)) if g > 1 else (k, v)
        delta = row_delta(dout, out)
        tiles = self._tiles(cfg, q.device)
        if tiles is None:
            dq, dk, dv = block_backward(dout, q, kk, vv, lse, delta, cfg.causal, cfg.scale, out=out)
        else:
            dq, dk, dv = tiled_backward(dout, q, kk, vv, lse, delta, *tiles, cfg.scale, out=out)
        if g > 1:
            dk, dv = (t.unflatten(2, (-1, g)).sum(3) for t in (dk, dv))
        dsinks = sink_grad(lse, delta, cfg.sinks) if cfg.sinks is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


SINGLE = Single()
