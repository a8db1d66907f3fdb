"""Prefill of new tokens over a persistent sequence-sharded KV cache (the next turn of a chat, an agent step),
with the new tokens sharded too. Four forward schedules and ``auto``: docs/internals.md, "Extend".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .agreement import code, exchange, require_same
from .comm import Comm, buffers
from .device import values_travel
from .kernels import attention_inputs, block_forward, fold_scale, softmax_scale_of
from .layouts import group_info
from .masks import TILE_ROWS
from .merge import acc_dtype, merge_, merge_sink_, new_accumulator
from .schedules import Message
from .strategies.extend import BATCH_ROWS, STRATEGIES, Shards, batches, extend_bytes, split_new  # noqa: F401

__all__ = ["STRATEGIES", "Shards", "RowMask", "split_new", "attend_rows", "extend_attention", "extend_bytes"]


def check_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, who: str) -> None:
    """ValueError unless q is (B, t, H, d) and k, v are (B, n, Hkv, d) with H % Hkv == 0."""
    B, _, H, d = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != d or H % max(1, k.shape[2]):
        raise ValueError(
            f"rank {rank}: {who} takes q (B, t, H, d) and k, v (B, n, Hkv, d) with H % Hkv == 0; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


@dataclass(frozen=True)
class RowMask:
    """A window (``left``) and documents (``bounds``) on top of causal attention, over global positions."""

    left: int = -1
    bounds: tuple[int, ...] = ()

    @property
    def plain(self) -> bool:
        return self.left < 0 and not self.bounds

    def visible(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        ok = kpos[None, :] <= qpos[:, None]
        if self.left >= 0:
            ok &= kpos[None, :] >= qpos[:, None] - self.left
        if self.bounds:
            edges = torch.tensor(self.bounds[1:-1], dtype=torch.int64, device=qpos.device)
            doc_q, doc_k = (torch.bucketize(p, edges, right=True) for p in (qpos, kpos))
            ok &= doc_q[:, None] == doc_k[None, :]
        return ok


def attend_rows(q, qa: int, k, v, kpos, ka: int, kb: int, start: int, mask: RowMask, scale: float):
    """The partial ``(out, lse)`` of new tokens ``qa..`` against one rank's rows (cached at ``kpos``, then new
    tokens ``ka..kb-1``), in the accumulator dtype."""
    B, tq, H, d = q.shape
    o, lse = new_accumulator(B, tq, H, d, q.dtype, q.device)
    old, qb = k.shape[1] - (kb - ka), qa + tq

    def add(rows: slice, keys: slice, causal: bool = False, vis=None):
        merge_(o[:, rows], lse[:, :, rows], *block_forward(q[:, rows], k[:, keys], v[:, keys], causal, scale, mask=vis))

    if not mask.plain:  # explicit masks from global positions, TILE_ROWS query rows at a time
        qpos = torch.arange(start + qa, start + qb, device=q.device)
        newpos = torch.arange(start + ka, start + kb, device=q.device)
        allpos = torch.cat([kpos.to(q.device, torch.int64), newpos])
        for r0 in range(0, tq, TILE_ROWS):
            r1 = min(tq, r0 + TILE_ROWS)
            vis = mask.visible(qpos[r0:r1], allpos)
            cols = vis.any(0).nonzero().flatten()
            if len(cols):  # only the span of keys some row of the tile sees
                c0, c1 = int(cols[0]), int(cols[-1]) + 1
                add(slice(r0, r1), slice(c0, c1), vis=vis[:, c0:c1])
        return o, lse
    if old:  # every cached row precedes every new token
        add(slice(0, tq), slice(0, old))
    lo, hi = max(qa, ka), min(qb, kb)
    if lo < hi:  # queries among these new keys: keys ka..lo-1 in full, then the causal square lo..hi-1
        if lo > ka:
            add(slice(lo - qa, hi - qa), slice(old, old + lo - ka))
        add(slice(lo - qa, hi - qa), slice(old + lo - ka, old + hi - ka), causal=True)
    if kb > ka and qb > max(qa, kb):  # queries after every new key here
        add(slice(max(qa, kb) - qa, tq), slice(old, old + kb - ka))
    return o, lse


def _meets(shards: Shards, ranges, mask: RowMask, qj: int, kj: int) -> bool:
    """Whether rank ``qj``'s queries see any row of rank ``kj`` (``ranges[j]``: its cached positions' range)."""
    a, b = shards.new[qj]
    if a == b:
        return False
    ka, kb = shards.new[kj]
    sees_new = kb > ka and ka < b
    if not shards.cached(kj):
        return sees_new
    if mask.left >= 0 and ranges[kj][1] < shards.start + a - mask.left:
        return sees_new  # every cached row of kj is out of the window of qj's first query
    return True


_HEADER = ["batch", "query heads", "key/value heads", "head dim", "dtype", "strategy", "window", "documents", "scale"]
_WHO = "tokenring extend"


def _exchange_header(
    B, t, n, H, Hkv, d, dtype, new, strategy, mask, scale, pos_range, state, rank, P, group
) -> tuple[Shards, list] | None:
    """All ranks' shapes, agreed or a ``ValueError`` on every rank (``None`` on the fake process group)."""
    same = [B, H, Hkv, d, code(dtype), code(strategy), mask.left, code(mask.bounds), code(scale)]
    rows = exchange([*same, *map(float, state), t, n, *new, *pos_range], group, rank, P, _WHO, "the step's shapes")
    if rows is None:
        return None
    k = len(same) + len(state)
    require_same(
        rows,
        _HEADER + [f"state[{i}]" for i in range(len(state))],
        rank,
        _WHO,
        "Every rank must run the same step of the same model over caches from the same prefill",
        doing="extends",
    )
    shards = Shards(tuple(int(x[k + 1]) for x in rows), tuple((int(x[k + 2]), int(x[k + 3])) for x in rows))
    bad_t = [r for r, x in enumerate(rows) if x[k] != x[k + 3] - x[k + 2]]
    problem = f"rank(s) {bad_t} pass queries that are not their new tokens" if bad_t else shards.problem()
    if problem:
        raise ValueError(f"tokenring extend (rank {rank}): {problem}")
    return shards, [(x[k + 4], x[k + 5]) for x in rows]


class _Run:
    """One call on one rank: the inputs, the shards, and the messages (through :class:`Comm`)."""

    def __init__(self, q, k, v, kpos, shards, ranges, mask, scale, rank, group, log):
        self.q, self.k, self.v, self.kpos = q, k, v, kpos
        self.shards, self.ranges, self.mask, self.scale = shards, ranges, mask, scale
        self.rank, self.P = rank, shards.P
        self.comm = Comm(group, what="extend")
        self.log = log

    def attend(self, q, qa, k, v, kpos, kj):
        ka, kb = self.shards.new[kj]
        return attend_rows(q, qa, k, v, kpos, ka, kb, self.shards.start, self.mask, self.scale)

    def attend_many(self, qs: list, qas: list[int]) -> list[tuple]:
        """This rank's rows attended by several ranks' queries, the cached block in one kernel call for all."""
        r = self.rank
        if len(qs) == 1 or not self.mask.plain:
            return [self.attend(q, qa, self.k, self.v, self.kpos, r) for q, qa in zip(qs, qas)]
        ka, kb = self.shards.new[r]
        old = self.k.shape[1] - (kb - ka)
        B, _, H, d = qs[0].shape
        rows = [q.shape[1] for q in qs]
        o, lse = new_accumulator(B, sum(rows), H, d, qs[0].dtype, qs[0].device)
        if old:
            merge_(o, lse, *block_forward(torch.cat(qs, 1), self.k[:, :old], self.v[:, :old], False, self.scale))
        out, at, after = [], 0, []
        kn, vn = self.k[:, old:], self.v[:, old:]
        for q, qa, n in zip(qs, qas, rows):
            part = (o[:, at : at + n], lse[:, :, at : at + n])
            if kb > ka and qa >= kb:  # after every new row here: one full block for all such ranks, below
                after.append((q, part))
            elif kb > ka:  # the new rows, as a shard of no cached rows
                merge_(*part, *attend_rows(q, qa, kn, vn, None, ka, kb, 0, self.mask, self.scale))
            out.append(part)
            at += n
        if after:
            o2, lse2 = block_forward(torch.cat([q for q, _ in after], 1), kn, vn, False, self.scale)
            at = 0
            for q, part in after:
                n = q.shape[1]
                merge_(*part, o2[:, at : at + n], lse2[:, :, at : at + n])
                at += n
        return out

    def meets(self, qj, kj) -> bool:
        return _meets(self.shards, self.ranges, self.mask, qj, kj)

    def post(self, step: int, sends=(), recvs=()):
        """Post messages ``(Message, tensors)``: every message's tag comes from its (step, kind, owner)."""
        tagged = lambda items: [(m, ts, (m.ready if m.ready >= 0 else step, m.owner)) for m, ts in items]  # noqa: E731
        return self.comm.start(step, tagged(sends), tagged(recvs))

    def done(self, strategy: str):
        if self.log is not None:
            got = sum(x["bytes"] for x in self.comm.log if x["direction"] == "recv")
            devices = sorted({x["device"] for x in self.comm.log})  # where the message buffers were
            self.log.append({"bytes": got, "strategy": strategy, "devices": devices})

    def q_like(self, j):
        B, _, H, d = self.q.shape
        return [torch.empty(B, self.shards.t(j), H, d, dtype=self.q.dtype, device=self.q.device)]

    def out_like(self, j):
        B, _, H, d = self.q.shape
        t, acc = self.shards.t(j), acc_dtype(self.q.dtype)
        return buffers([((B, t, H, d), acc), ((B, H, t), acc)], self.q.device)

    def kv_like(self, j):
        B, _, Hkv, d = self.k.shape
        n, dev = self.shards.rows[j], self.k.device
        specs = [((B, n, Hkv, d), self.k.dtype)] * 2
        if not self.mask.plain:
            specs.append(((self.shards.cached(j),), torch.int64))
        return buffers(specs, dev)

    def kv_mine(self):
        return [self.k, self.v] + ([self.kpos] if not self.mask.plain else [])


def _wait_all(pending) -> None:
    for p in pending:
        p.wait()


def _merge_home(run: _Run, own, partials: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """My queries' partials, mine and those that came home, merged in rank order."""
    out, out_lse = new_accumulator(*run.q.shape, run.q.dtype, run.q.device)
    for j in range(run.P):
        if j == run.rank and own is not None:
            merge_(out, out_lse, *own)
        elif j in partials:
            merge_(out, out_lse, *partials[j])
    return out, out_lse


def _pass_q(run: _Run) -> torch.Tensor:
    """Direct: queries straight to every rank at once, partials straight home, merged in rank order."""
    r, P, sh = run.rank, run.P, run.shards
    peers = [(r + i) % P for i in range(1, P)]
    visitors = [j for j in peers if run.meets(j, r)]  # whose queries I attend, in this order (step i)
    helpers = [j for j in peers if run.meets(r, j)]  # who attends mine
    step_of = {j: 1 + (r - j) % P for j in peers}  # the step at which rank j attends my queries (its order)
    got = {j: run.q_like(j) for j in visitors}
    partials = {j: run.out_like(r) for j in helpers}
    out_recvs = [(Message(j, r, "out", r, due=P + 1, ready=step_of[j]), partials[j]) for j in helpers]
    pend = run.post(
        0,
        sends=[(Message(r, j, "q", r), [run.q]) for j in helpers],
        recvs=[(Message(j, r, "q", j, due=1 + (j - r) % P), got[j]) for j in visitors]
        + (out_recvs if run.comm.early_receives else []),
    )
    waits = {p.due: p for p in pend}
    sent, own = [], None
    for group in batches([r] * run.meets(r, r) + visitors, sh):  # own rows first, while queries arrive
        for j in group:
            if j != r:
                waits.pop(1 + (j - r) % P).wait()
        qs = [run.q if j == r else got.pop(j)[0] for j in group]
        for j, part in zip(group, run.attend_many(qs, [sh.new[j][0] for j in group])):
            if j == r:
                own = part
            else:
                i = 1 + (j - r) % P
                sent += run.post(i, sends=[(Message(r, j, "out", j, ready=i), list(part))])
    rest = list(waits.values()) + (run.post(P, recvs=out_recvs) if not run.comm.early_receives else [])
    _wait_all(rest + sent)
    return _merge_home(run, own, partials)


def _pass_q_relay(run: _Run) -> torch.Tensor:
    """The paper's schedule: queries travel ``r+1 -> r``, partials go straight home."""
    r, P, sh = run.rank, run.P, run.shards
    nxt, prv = (r + 1) % P, (r - 1) % P
    helpers = [j for j in range(P) if j != r and run.meets(r, j)]
    partials = {j: run.out_like(r) for j in helpers}
    out_recvs = [(Message(j, r, "out", r, due=P + 1, ready=(r - j) % P), partials[j]) for j in helpers]
    pend = run.post(0, recvs=out_recvs) if run.comm.early_receives else []
    held, sent = [run.q], []
    own = None
    for i in range(P):
        j = (r + i) % P
        step = []
        if i + 1 < P:  # the queries of r+i+1 arrive from r+1; those I hold go on to r-1 (not back to their owner)
            incoming = run.q_like((j + 1) % P)
            step = run.post(
                i,
                sends=[(Message(r, prv, "q", j), held)] if i + 1 < P and prv != j else [],
                recvs=[(Message(nxt, r, "q", (j + 1) % P), incoming)],
            )
        if run.meets(j, r):
            part = run.attend(held[0], sh.new[j][0], run.k, run.v, run.kpos, r)
            if j == r:
                own = part
            else:
                sent += run.post(i, sends=[(Message(r, j, "out", j, ready=i), list(part))])
        _wait_all(step)
        if i + 1 < P:
            held = incoming
    if not run.comm.early_receives:
        pend = run.post(P, recvs=out_recvs)
    _wait_all(pend + sent)
    return _merge_home(run, own, partials)


def _pass_kv(run: _Run) -> torch.Tensor:
    """Ring attention: K/V rows travel ``r -> r+1`` while each rank attends its queries to them."""
    r, P, sh = run.rank, run.P, run.shards
    nxt, prv = (r + 1) % P, (r - 1) % P
    a = sh.new[r][0]
    out, out_lse = new_accumulator(*run.q.shape, run.q.dtype, run.q.device)
    held = run.kv_mine()
    for i in range(P):
        j = (r - i) % P
        step = []
        if i + 1 < P:
            incoming = run.kv_like((j - 1) % P)
            step = run.post(
                i,
                sends=[(Message(r, nxt, "kv", j), held)] if nxt != j else [],
                recvs=[(Message(prv, r, "kv", (j - 1) % P), incoming)],
            )
        if sh.t(r) and run.meets(r, j):
            kpos = held[2] if len(held) > 2 else None
            merge_(out, out_lse, *run.attend(run.q, a, held[0], held[1], kpos, j))
        _wait_all(step)
        if i + 1 < P:
            held = list(incoming)
    return out, out_lse


def _ulysses(run: _Run) -> torch.Tensor:
    """All-to-all by heads, attend, and all-to-all each rank's rows of the output back."""
    r, P, sh = run.rank, run.P, run.shards
    B, t, H, d = run.q.shape
    Hkv = run.k.shape[2]
    h, hk = H // P, Hkv // P
    qg = lambda x, j: x[:, :, j * h : (j + 1) * h].contiguous()  # noqa: E731
    kg = lambda x, j: x[:, :, j * hk : (j + 1) * hk].contiguous()  # noqa: E731
    extra = [run.kpos] if not run.mask.plain else []
    pos_spec = lambda j: [((sh.cached(j),), torch.int64)] if extra else []  # noqa: E731
    got = {
        j: buffers(
            [((B, sh.t(j), h, d), run.q.dtype)] + [((B, sh.rows[j], hk, d), run.k.dtype)] * 2 + pos_spec(j),
            run.q.device,
        )
        for j in range(P)
        if j != r
    }
    _wait_all(
        run.post(
            0,
            sends=[(Message(r, j, "u_qkv", r), [qg(run.q, j), kg(run.k, j), kg(run.v, j), *extra]) for j in got],
            recvs=[(Message(j, r, "u_qkv", j), got[j]) for j in got],
        )
    )
    got[r] = [qg(run.q, r), kg(run.k, r), kg(run.v, r), *extra]
    q_all = torch.empty(B, sh.T, h, d, dtype=run.q.dtype, device=run.q.device)
    for j in range(P):
        a, b = sh.new[j]
        q_all[:, a:b] = got[j][0]
    o, lse = new_accumulator(B, sh.T, h, d, run.q.dtype, run.q.device)
    for j in range(P):
        part = got[j]
        merge_(o, lse, *run.attend(q_all, 0, part[1], part[2], part[3] if extra else None, j))
    if run.sinks is not None:  # this head group's sinks, on finished rows
        merge_sink_(o, lse, run.sinks[r * h : (r + 1) * h])
    o = o.to(run.q.dtype)
    back = {j: [torch.empty(B, t, h, d, dtype=run.q.dtype, device=run.q.device)] for j in range(P) if j != r}
    _wait_all(
        run.post(
            1,
            sends=[(Message(r, j, "u_out", j), [o[:, slice(*sh.new[j])]]) for j in back],
            recvs=[(Message(j, r, "u_out", r), back[j]) for j in back],
        )
    )
    back[r] = [o[:, slice(*sh.new[r])]]
    return torch.cat([back[j][0] for j in range(P)], dim=2), None


def _choose(shards: Shards, B, H, Hkv, d, q, rank: int, P: int, group, agree: bool) -> str:
    """``auto``: the schedule the simulator predicts fastest; with ``agree``, rank 0's choice on every rank."""
    from .sim.extend import choose

    mine = choose(shards, B, H, Hkv, d, q.dtype, q.device.type)
    if not agree or not values_travel(group):
        return mine
    rows = exchange([float(STRATEGIES.index(mine))], group, rank, P, _WHO, "the chosen schedule")
    return STRATEGIES[int(rows[0][0])]


_SCHEDULES = {"pass_q": _pass_q, "pass_q_relay": _pass_q_relay, "pass_kv": _pass_kv, "ulysses": _ulysses}


def _check_turn(q, k, v, new, mask, positions, strategy: str, rank: int, P: int) -> None:
    """ValueError, before any rank is asked, for rows, new tokens, positions or a strategy this rank refuses."""
    check_rows(q, k, v, rank, "extend_attention")
    t, H = q.shape[1], q.shape[2]
    Hkv, n = k.shape[2], k.shape[1]
    if new[1] - new[0] != t or t > n:
        raise ValueError(
            f"rank {rank}: new={new} must be the token indices of this rank's {t} queries, stored as the last "
            f"{t} of its {n} rows"
        )
    if not mask.plain and (positions is None or positions.shape != (n - t,)):
        raise ValueError(
            f"rank {rank}: a window or documents need positions=, the global positions of this rank's "
            f"{n - t} cached rows (got {None if positions is None else tuple(positions.shape)})"
        )
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or 'auto'")
    if P > 1 and strategy == "ulysses" and (H % P or Hkv % P):
        raise ValueError(
            f"tokenring extend: ulysses splits the heads over the ranks and needs query heads ({H}) and key/value "
            f"heads ({Hkv}) divisible by P={P}; use strategy='pass_q'"
        )


def _agreed_shards(header: tuple, shards, checked: bool, rank: int, P: int, group):
    """Every rank's shards and cached position range: from the header exchange when ``checked``, else from
    ``shards=`` (and, with a window, one small exchange of the ranges)."""
    got = _exchange_header(*header, rank, P, group) if checked else None
    if got is not None:
        return got
    if shards is None:
        raise ValueError(f"rank {rank}: on PyTorch's fake process group extend_attention needs shards=")
    pos_range, mask = header[11], header[9]
    if mask.plain:
        return shards, [pos_range] * P  # not used without a window
    rows = exchange(pos_range, group, rank, P, _WHO, "the cached positions")
    return shards, [tuple(x) for x in rows] if rows is not None else [pos_range] * P  # fake group: shapes only


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    new: tuple[int, int],
    strategy: str = "auto",
    softmax_scale: float | None = None,
    window: int | None = None,
    cu_seqlens=None,
    positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    group=None,
    shards: Shards | None = None,
    state: tuple = (),
    log: list | None = None,
) -> torch.Tensor:
    """Attention of this rank's share ``q`` (B, t, H, d) of new tokens ``new = (a, b)`` over its K/V rows ``k``,
    ``v`` (B, n, Hkv, d: cached, then its new tokens), sharded over ``group``. Returns (B, t, H, d); the
    arguments in full: docs/internals.md, "Extend"."""
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: zero columns make the head dims equal (see value_dim_apart)
        return extend_attention(
            q, k, v, new=new, strategy=strategy, softmax_scale=softmax_scale, window=window, cu_seqlens=cu_seqlens,
            positions=positions, sinks=sinks, group=group, shards=shards, state=state, log=log,
        )[..., :dv]  # fmt: skip
    rank, P = group_info(group)
    B, t, H, d = q.shape
    Hkv, n = k.shape[2], k.shape[1]
    a, b = new
    mask = RowMask(-1 if window is None else int(window), tuple(int(x) for x in cu_seqlens) if cu_seqlens else ())
    _check_turn(q, k, v, new, mask, positions, strategy, rank, P)
    scale = softmax_scale_of(softmax_scale, d)
    q, scale = fold_scale(q, scale)
    if P == 1:
        out, lse = attend_rows(q, a, k, v, positions, a, b, n - t, mask, scale)
        if sinks is not None:
            merge_sink_(out, lse, sinks)
        return out.to(q.dtype)
    pos_range = (
        (float(positions.min()), float(positions.max())) if positions is not None and len(positions) else (-1.0, -1.0)
    )
    checked = shards is None or state is not None
    header = (B, t, n, H, Hkv, d, q.dtype, new, strategy, mask, scale, pos_range, state or ())
    shards, ranges = _agreed_shards(header, shards, checked, rank, P, group)
    if strategy == "auto":
        strategy = _choose(shards, B, H, Hkv, d, q, rank, P, group, agree=checked)
    run = _Run(q, k, v, positions, shards, ranges, mask, scale, rank, group, log)
    run.sinks = sinks
    out, lse = _SCHEDULES[strategy](run)
    if lse is not None and sinks is not None:
        merge_sink_(out, lse, sinks)
    run.done(strategy)
    return out.to(q.dtype)
