"""Any PyTorch model: every ``F.scaled_dot_product_attention`` call inside a block runs sequence-parallel.

    with tokenring.context_parallel(group, buffers=[tokens, labels, freqs_cis], seq_dims=[1, 1, 0]):
        loss = model(tokens, labels)          # the model's SDPA calls see this rank's shard; tokenring joins them
        loss.backward()
    # the buffers hold the whole sequence again

The shape of PyTorch's ``context_parallel`` (TorchTitan): on entry each buffer is replaced, in place, by this
rank's shard along its sequence dim (``layout``: zigzag by default, which balances causal work; ``"auto"``, with
``cu_seqlens``: the cost model's placement of those documents, :func:`tokenring.layouts.resolve_layout`); inside, every
SDPA call with ``attn_mask=None`` becomes :func:`tokenring.attention` over the group (``is_causal``, ``scale``
and ``enable_gqa`` as SDPA reads them; packed documents and windows through ``cu_seqlens=`` / ``window=``,
over the global sequence); on exit the buffers are gathered back (except ``no_restore_buffers``). Buffers of
any one length: their shards may be uneven, and the SDPA calls pass that length on as ``seq_len``. Buffers of
several lengths (joint text + image streams, each split over the ranks on its own): a call that is not causal,
without documents or a window, over rows that are this rank's shards of some of the lengths together runs with
every rank's row count (``rows=``), which each rank works out alike from the lengths. Anything
SDPA does that tokenring cannot express (a mask tensor, dropout) raises a ValueError on every rank: every rank
runs the same model, so every rank meets the same call.

Why a ``TorchFunctionMode`` and not a patched function: it sees calls made through ``torch.nn.functional``,
``torch._C._nn`` or a module's own alias alike, and it ends with the block.
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .agreement import exchange
from .api import attention
from .layouts import check_layout, gather, group_info, padded_length, resolve_layout, shard, shard_positions

__all__ = ["context_parallel"]


def _group_of(group_or_mesh):
    """A process group from a group, a 1-D DeviceMesh, a mesh with a ``cp`` dim, or ``None`` (the default)."""
    if group_or_mesh is None or not hasattr(group_or_mesh, "get_group"):
        return group_or_mesh
    mesh = group_or_mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        raise ValueError(
            f"tokenring.context_parallel: a {mesh.ndim}-D mesh needs a dim named 'cp' to shard the sequence over "
            f"(its dims: {names}); pass mesh['cp'] or a process group"
        )
    return mesh["cp"].get_group()


class _SDPA(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to :func:`tokenring.attention` while the block is open."""

    def __init__(self, group, strategy: str, layout: str, cu_seqlens, window, seq_len, lengths):
        super().__init__()
        self.group, self.strategy, self.layout = group, strategy, layout
        self.cu_seqlens, self.window, self.seq_len = cu_seqlens, window, seq_len
        self.uneven_rows = _rows_if_uneven(group, layout, seq_len)
        self.joint = _joint_rows(group, layout, lengths) if len(lengths) > 1 else {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        where = "tokenring.context_parallel: scaled_dot_product_attention"
        if attn_mask is not None:
            raise ValueError(
                f"{where} got an attn_mask of shape {tuple(attn_mask.shape)}; a mask tensor over local rows cannot "
                f"say what a sharded sequence sees. Use is_causal=True, no mask, or packed documents / a window "
                f"through context_parallel(cu_seqlens=..., window=...)"
            )
        if dropout_p:
            raise ValueError(f"{where} got dropout_p={dropout_p}; attention dropout is not supported (use 0)")
        if query.dim() != 4:
            raise ValueError(
                f"{where} takes (batch, heads, seq, head_dim) tensors here, got query {tuple(query.shape)}"
            )
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(
                f"{where}: query has {query.shape[1]} heads and key {key.shape[1]} without enable_gqa=True "
                f"(SDPA itself refuses this)"
            )
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, s, H, d), tokenring's layout
        rows = None
        if self.joint and not is_causal and self.cu_seqlens is None and self.window is None:
            n = q.shape[1]
            rows = self.joint.get(n, ()) if k.shape[1] == n else ()
            if rows is None:  # this count could be more than one join of the streams: ask the others
                rank, P = group_info(self.group)
                every = exchange([float(n)], self.group, rank, P, "tokenring.context_parallel", "row counts")
                rows = tuple(int(r[0]) for r in every) if every is not None else ()
            rows = rows or None
        # (the mode is off while its handler runs: tokenring's own SDPA calls on blocks are not caught again)
        out = attention(
            q,
            k,
            v,
            causal=bool(is_causal),
            softmax_scale=scale,
            strategy=self.strategy,
            layout=self.layout,
            cu_seqlens=self.cu_seqlens,
            window=self.window,
            group=self.group,
            seq_len=self.seq_len if q.shape[1] == self.uneven_rows and rows is None else None,
            rows=rows,
        )
        return out.transpose(1, 2)


def _rows_if_uneven(group, layout: str, S: int | None) -> int | None:
    """This rank's rows of the buffers' length ``S`` when the layout splits it unevenly (else ``None``): an SDPA
    call over that many rows runs with ``seq_len=S``."""
    rank, P = group_info(group)
    if S is None or S == padded_length(S, P, layout):
        return None
    return len(shard_positions(S, P, rank, layout))


def _joint_rows(group, layout: str, lengths: list[int]) -> dict:
    """For buffers of several ``lengths``: this rank's row count of each sum of their shards (lengths joined,
    each at most once) -> every rank's count (rank order), or ``None`` where the count alone cannot say which
    (then the ranks exchange their counts at each such call). Every rank decides alike: a sum is ambiguous when
    on some rank another sum gives the same count with other counts, and the true sum is a candidate on every
    rank, so either every rank knows it alone or every rank meets an ambiguous candidate and asks."""
    rank, P = group_info(group)
    counts = {L: [len(shard_positions(L, P, r, layout)) for r in range(P)] for L in sorted(set(lengths))[:8]}
    sums = set()
    for pick in range(1, 1 << len(counts)):
        chosen = [L for i, L in enumerate(counts) if pick >> i & 1]
        sums.add(tuple(sum(counts[L][r] for L in chosen) for r in range(P)))

    def ambiguous(rows) -> bool:
        return any(other[r] == rows[r] and other != rows for r in range(P) for other in sums)

    out: dict = {}
    for rows in sums:
        n = rows[rank]
        out[n] = None if n in out or ambiguous(rows) else rows
    return out


@contextlib.contextmanager
def context_parallel(
    group_or_mesh=None,
    *,
    buffers=(),
    seq_dims=(),
    no_restore_buffers=(),
    strategy: str = "auto",
    layout: str = "zigzag",
    cu_seqlens=None,
    window: tuple[int, int] | None = None,
):
    """Inside this block, shard ``buffers`` (full tensors, the same on every rank) along ``seq_dims`` in place and
    run every ``F.scaled_dot_product_attention`` call sequence-parallel over ``group_or_mesh`` (a process group,
    a 1-D DeviceMesh or a mesh with a ``cp`` dim; default: every rank). See the module doc."""
    buffers, seq_dims = list(buffers), list(seq_dims)
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"tokenring.context_parallel: {len(buffers)} buffers but {len(seq_dims)} seq_dims; give one dim per buffer"
        )
    check_layout(layout, auto=True)
    group = _group_of(group_or_mesh)
    keep = {id(b) for b in no_restore_buffers}
    lengths = [b.shape[d] for b, d in zip(buffers, seq_dims)]
    seq_len = lengths[0] if len(set(lengths)) == 1 else None  # any length: the SDPA calls' rows are its shards
    layout = resolve_layout(layout, seq_len, group_info(group)[1], cu_seqlens, need_documents=True)  # "auto"
    for b, d in zip(buffers, seq_dims):
        b.data = shard(b.data, dim=d, layout=layout, group=group, cu_seqlens=cu_seqlens).contiguous()
    mode = _SDPA(group, strategy, layout, cu_seqlens, window, seq_len, sorted(set(lengths)))
    try:
        with mode:
            yield
    finally:
        for b, d, L in zip(buffers, seq_dims, lengths):
            if id(b) not in keep:
                b.data = gather(b.data, dim=d, layout=layout, group=group, cu_seqlens=cu_seqlens, seq_len=L)
