"""Ulysses (DeepSpeed-Ulysses): all-to-all from sequence shards to head shards and back.

Step 0 sends rank ``p`` the ``p``-th group of ``H/P`` query heads (and ``Hkv'/P`` K/V heads) of my rows; step
1 runs full-sequence attention on my head group; step 2 returns each rank its rows of my heads. K/V heads
are repeated beforehand (in :meth:`Ulysses.prepare`, differentiably) to ``Hkv'``, the fewest that split
evenly over ``P``. The all-to-alls are point-to-point messages run by the same executor as the rings,
so they share byte accounting, timeouts and traces, and the simulator sees them too.
"""
from __future__ import annotations

import torch

from ..comm import buffers
from ..executor import execute
from ..kernels import block_backward, block_forward, tiled_backward, tiled_forward
from ..masks import whole_tiles
from ..layouts import global_order
from ..schedules import Compute, Message, Schedule, Shapes, Step, payload, ulysses_kv_heads
from .base import BlockDims, Config, Strategy, row_delta, tile_dims

__all__ = ["Ulysses", "STRATEGY"]


def _all_to_all(P: int, kind: str) -> list[Message]:
    return [Message(src, dst, kind, dst if kind in ("u_out", "u_grad") else src)
            for src in range(P) for dst in range(P) if src != dst]


def _schedule(P: int, layout: str, causal: bool, backward: bool, mask=None) -> Schedule:
    first, last = ("u_dout", "u_grad") if backward else ("u_qkv", "u_out")
    steps = [Step(messages=_all_to_all(P, first)),
             Step(computes=[Compute(r, r, "all", r, "all", causal) for r in range(P)]),
             Step(messages=_all_to_all(P, last))]
    return Schedule("ulysses", P, layout, causal, backward, first, steps, mask)


class _UlyssesOps:
    """Head-sharded full-sequence attention. ``sent`` holds, per message kind, my local tensors split by
    destination head group; ``got[src]`` what arrived from each source rank."""

    def __init__(self, sh: Shapes, cfg: Config, device, local: dict[str, list[torch.Tensor]]):
        self.sh, self.cfg, self.me, self.device = sh, cfg, cfg.rank, device
        self.local = local  # kind -> tensors (B, s, heads, d), split by head group when sent
        self.got: dict[int, list[torch.Tensor]] = {}
        S = sh.s * sh.P
        # Positions of the rank-ordered concatenation; argsort restores natural order for the causal mask.
        self.order = global_order(S, sh.P, cfg.layout, device=device, cu_seqlens=cfg.documents)
        self.inverse = torch.argsort(self.order)
        self.result: list[torch.Tensor] | None = None

    def _heads(self, t: torch.Tensor, p: int) -> torch.Tensor:
        h = t.shape[2] // self.sh.P
        return t[:, :, p * h:(p + 1) * h].contiguous()

    def payload(self, m: Message) -> list[torch.Tensor]:
        if m.kind in ("u_qkv", "u_dout"):
            return [self._heads(t, m.dst) for t in self.local[m.kind]]
        s = self.sh.s  # u_out / u_grad: rows of rank dst from my full-sequence result
        return [t[:, m.dst * s:(m.dst + 1) * s].contiguous() for t in self.result]

    def empty(self, m: Message) -> list[torch.Tensor]:
        return buffers(payload(m.kind, m.part, self.sh), self.device)

    def receive(self, m: Message, tensors) -> None:
        self.got[m.src] = tensors

    def release(self, step: int, reads: dict) -> None:
        pass  # nothing visits: what arrives is consumed whole by the one compute or reassembly

    def gathered(self, kind: str) -> list[torch.Tensor]:
        """Full sequence (natural order) of my head group, from what every rank sent me."""
        self.got[self.me] = [self._heads(t, self.me) for t in self.local[kind]]
        parts = zip(*(self.got[p] for p in range(self.sh.P)))
        return [torch.cat(ts, dim=1).index_select(1, self.inverse) for ts in parts]

    def scatter_back(self, full: list[torch.Tensor]) -> None:
        """Put a natural-order result in rank-concatenation order, ready to be cut into per-rank rows."""
        self.result = [t.index_select(1, self.order) for t in full]

    def heads_back(self, dtype_of: list[torch.dtype]) -> list[torch.Tensor]:
        """Reassemble my rows over all heads from every rank's head group."""
        s = self.sh.s
        self.got[self.me] = [t[:, self.me * s:(self.me + 1) * s] for t in self.result]
        parts = zip(*(self.got[p] for p in range(self.sh.P)))
        return [torch.cat(ts, dim=2).to(dt) for ts, dt in zip(parts, dtype_of)]


class _Forward(_UlyssesOps):
    def compute(self, c: Compute) -> None:
        q, k, v = self.gathered("u_qkv")
        if self.cfg.mask is None:
            o, lse = block_forward(q, k, v, c.diag, self.cfg.scale)
        else:  # documents / window: only the tiles they leave (no bytes saved: every head group is all rows)
            o, lse = tiled_forward(q, k, v, *whole_tiles(self.cfg.mask, q.device), self.cfg.scale)
        self.saved = (q, k, v, o, lse)  # my head group over the full sequence, for backward
        self.scatter_back([o])


class _Backward(_UlyssesOps):
    def __init__(self, sh, cfg, device, local, saved):
        super().__init__(sh, cfg, device, local)
        self.q, self.k, self.v, self.o, self.lse = saved

    def compute(self, c: Compute) -> None:
        (dout,) = self.gathered("u_dout")
        delta = row_delta(dout, self.o)
        if self.cfg.mask is None:
            dq, dk, dv = block_backward(dout, self.q, self.k, self.v, self.lse, delta, c.diag, self.cfg.scale,
                                        self.cfg.backward_kernel, out=self.o)
        else:
            dq, dk, dv = tiled_backward(dout, self.q, self.k, self.v, self.lse, delta,
                                        *whole_tiles(self.cfg.mask, dout.device), self.cfg.scale,
                                        self.cfg.backward_kernel, out=self.o)
        self.scatter_back([dq.to(self.q.dtype), dk.to(self.k.dtype), dv.to(self.v.dtype)])


class Ulysses(Strategy):
    name = "ulysses"

    def check(self, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
        if H % P:
            return (f"strategy='ulysses' needs the {H} query heads to divide over {P} ranks (H % P == 0); "
                    f"use strategy='token_ring' or 'ring', or a group size that divides {H}")
        return None

    def prepare(self, q, k, v, P: int):
        rep = ulysses_kv_heads(q.shape[2], k.shape[2], P) // k.shape[2]
        if rep > 1:  # replicate K/V heads so they split evenly over P (autograd sums their gradients back)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return q, k, v

    def build_schedule(self, P: int, layout: str, causal: bool, backward: bool, mask=None) -> Schedule:
        return _schedule(P, layout, causal, backward, mask)

    def block_dims(self, c: Compute, sh: Shapes, mask=None, layout: str = "contiguous") -> BlockDims:
        """The whole sequence over ``H/P`` query and ``Hkv'/P`` K/V heads, plus gathering the received head
        groups into one sequence (cat + reorder) and cutting the result back up."""
        S, e = sh.s * sh.P, sh.dtype.itemsize
        hq, hk = sh.H // sh.P, ulysses_kv_heads(sh.H, sh.Hkv, sh.P) // sh.P
        copies = (sh.B * S * (hq + 2 * hk) * sh.d * e * 2, sh.B * S * hq * sh.d * e)
        tiles = None if mask is None else tile_dims(whole_tiles(mask)[0], sh.B)
        return BlockDims(sh.B * S, S, hq, hk, copies, tiles)

    def forward(self, q, k, v, cfg: Config):
        sh = Shapes(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, cfg.P)
        ops = _Forward(sh, cfg, q.device, {"u_qkv": [q, k, v]})
        execute(self.schedule(cfg.P, cfg.layout, cfg.causal, False, cfg.mask), cfg.comm("ulysses forward"), ops)
        (out,) = ops.heads_back([q.dtype])
        return out, ops.saved

    def backward(self, dout, saved, cfg: Config):
        qh, kh, vh, oh, lseh = saved
        B, S, hq, d = qh.shape
        sh = Shapes(B, S // cfg.P, hq * cfg.P, kh.shape[2] * cfg.P, d, qh.dtype, cfg.P)
        ops = _Backward(sh, cfg, dout.device, {"u_dout": [dout]}, saved)
        execute(self.schedule(cfg.P, cfg.layout, cfg.causal, True, cfg.mask), cfg.comm("ulysses backward"), ops)
        return tuple(ops.heads_back([qh.dtype, kh.dtype, vh.dtype]))


STRATEGY = Ulysses()
