"""Any PyTorch model: every ``F.scaled_dot_product_attention`` call inside a block runs sequence-parallel.

    with tokenring.context_parallel(group, buffers=[tokens, labels, freqs_cis], seq_dims=[1, 1, 0]):
        loss = model(tokens, labels)          # the model's SDPA calls see this rank's shard; tokenring joins them
        loss.backward()
    # the buffers hold the whole sequence again

The shape of PyTorch's ``context_parallel`` (TorchTitan): on entry each buffer is replaced, in place, by this
rank's shard along its sequence dim (``layout``: zigzag by default, which balances causal work); inside, every
SDPA call with ``attn_mask=None`` becomes :func:`tokenring.attention` over the group (``is_causal``, ``scale``
and ``enable_gqa`` as SDPA reads them; packed documents and windows through ``cu_seqlens=`` / ``window=``,
over the global sequence); on exit the buffers are gathered back (except ``no_restore_buffers``). Buffers of
any one length: their shards may be uneven, and the SDPA calls pass that length on as ``seq_len``. Anything
SDPA does that tokenring cannot express (a mask tensor, dropout) raises a ValueError on every rank: every rank
runs the same model, so every rank meets the same call.

Why a ``TorchFunctionMode`` and not a patched function: it sees calls made through ``torch.nn.functional``,
``torch._C._nn`` or a module's own alias alike, and it ends with the block.
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .api import attention
from .layouts import check_layout, gather, group_info, padded_length, shard, shard_positions

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

    def __init__(self, group, strategy: str, layout: str, cu_seqlens, window, seq_len):
        super().__init__()
        self.group, self.strategy, self.layout = group, strategy, layout
        self.cu_seqlens, self.window, self.seq_len = cu_seqlens, window, seq_len
        self.uneven_rows = _uneven_rows(group, layout, seq_len)

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
            seq_len=self.seq_len if q.shape[1] == self.uneven_rows else None,
        )
        return out.transpose(1, 2)


def _uneven_rows(group, layout: str, S: int | None) -> int | None:
    """This rank's rows of the buffers' length ``S`` when the layout splits it unevenly (else ``None``): an SDPA
    call over that many rows runs with ``seq_len=S``."""
    rank, P = group_info(group)
    if S is None or S == padded_length(S, P, layout):
        return None
    return len(shard_positions(S, P, rank, layout))


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
    check_layout(layout)
    group = _group_of(group_or_mesh)
    keep = {id(b) for b in no_restore_buffers}
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims)}
    seq_len = lengths.pop() if len(lengths) == 1 else None  # any length: the SDPA calls' rows are its shards
    for b, d in zip(buffers, seq_dims):
        b.data = shard(b.data, dim=d, layout=layout, group=group, cu_seqlens=cu_seqlens).contiguous()
    mode = _SDPA(group, strategy, layout, cu_seqlens, window, seq_len)
    try:
        with mode:
            yield
    finally:
        for b, d in zip(buffers, seq_dims):
            if id(b) not in keep:
                b.data = gather(b.data, dim=d, layout=layout, group=group, cu_seqlens=cu_seqlens, seq_len=seq_len)
