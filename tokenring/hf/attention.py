"""``attn_implementation="tokenring"``: the attention function and mask function transformers calls, the
checks of what a layer is given, and the preparation of a model's sequence mixers.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .. import mixers as _mixers
from ..agreement import exchange
from ..api import attention
from ..device import collective_device, values_travel
from ..instrument import instrument
from ..layouts import DOCUMENT_LAYOUTS, gather, group_info
from ..ops import IdentityCache, _group_name, _plain_eager, _pretended_meta, placed_layout, resolve_group
from .cache import forget_steps, step_attention, take_step
from .config import NAME, _settings
from .ddp import check_ddp
from .masks import _mask_problem

__all__ = ["attention_forward", "mask_forward", "prepare", "register"]


def _settings_group():
    """The group of the settings, the default group for ``None`` (what DDP's wiring is compared with)."""
    return _settings.group if _settings.group is not None else dist.group.WORLD


def _where(module) -> str:
    layer = getattr(module, "layer_idx", None)
    return f"layer {layer}" if layer is not None else type(module).__name__


def _refuse(module, why: str) -> ValueError:
    where = module if isinstance(module, str) else _where(module)
    return ValueError(f"tokenring (attn_implementation='tokenring', {where}): {why}")


def _documents(full: torch.Tensor, local_default: bool, S: int, layout: str) -> tuple[list[int] | None, str | None]:
    """Documents of a batch from its global position ids ``full`` (B, S), natural order, as transformers reads
    them (a new document wherever a position is not the previous one plus 1): ``(cu_seqlens or None, problem)``.
    ``local_default``: every rank's positions are ``0..s-1``, which is what transformers makes up when
    ``position_ids`` are omitted."""
    starts = torch.diff(full, dim=-1) != 1
    if not bool(starts.any()):
        return None, None  # one document: plain (causal) attention over the whole sequence
    h = min(3, S)
    if local_default:
        return None, (
            f"every rank's position_ids are 0..s-1, which is what transformers uses when position_ids "
            f"are omitted. Pass this rank's global "
            f"positions: position_ids=tokenring.shard(torch.arange(S)[None], dim=1, layout={layout!r}) "
            f"(or use tokenring.hf.shard_batch); for packed documents of exactly one shard each, "
            f"pass cu_seq_lens_q over the global sequence (shard_batch does)"
        )
    if bool((starts != starts[:1]).any()):
        return None, (
            "the rows of this batch pack different documents (position_ids restart at different places); "
            "packed batches must share one packing (DataCollatorWithFlattening makes batch 1)"
        )
    cuts = (starts[0].nonzero().flatten() + 1).tolist()
    firsts = full[:, [0] + cuts]
    if bool((firsts != 0).any()):
        return None, (
            f"position_ids restart inside the sequence (packed documents?) but documents do not start at "
            f"position 0 (first positions {firsts[0, :h].tolist()}...): pass this rank's shard of the "
            f"global position_ids (tokenring.hf.shard_batch(input_ids, position_ids=...)) with "
            f"layout={layout!r}"
        )
    return [0] + cuts + [S], None


def _padding_problem(full_mask: torch.Tensor) -> str | None:
    """A whole batch's 2D mask (B, S): padding on the left, the right or both is fine; a hole (pads between real
    tokens of one row) is refused."""
    m = full_mask.to(torch.bool)
    real_before = m.cumsum(1)[:, :-1] > 0
    if bool((m[:, 1:] & ~m[:, :-1] & real_before).any()):
        return (
            "the attention mask has pads between the real tokens of a row (a hole), which documents cannot "
            "express; pad on the left or the right only, or pack the rows (DataCollatorWithFlattening)"
        )
    return None


def _padding_documents(full_mask: torch.Tensor, causal: bool) -> list[list[int]] | None:
    """Each row's documents (``cu_seqlens``): its real tokens one document, each run of pads another, so a real
    token sees only real tokens of its row, as transformers' padding mask says. ``None`` when nothing needs them:
    no padding, or right padding under causal attention (no real token sees a later pad; pads carry no loss)."""
    m = full_mask.to(torch.bool)
    if bool(m.all()) or (causal and not bool((m[:, 1:] & ~m[:, :-1]).any())):
        return None
    S = m.shape[1]
    cuts = (m[:, 1:] != m[:, :-1]).nonzero().tolist()
    rows: list[list[int]] = [[0] for _ in range(m.shape[0])]
    for b, j in cuts:
        rows[b].append(j + 1)
    return [row + [S] for row in rows]


def _gathered(t: torch.Tensor, layout: str, group, device, docs=None) -> torch.Tensor:
    """The full ``(B, S)`` tensor, in natural order, from every rank's ``(B, s)`` shard (on the CPU; ``docs``: the
    documents, for a layout that places tokens by document)."""
    S = t.shape[1] * group_info(group)[1]
    return gather(t.to(device), dim=1, layout=layout, group=group, cu_seqlens=docs, seq_len=S).cpu()


def _check_heads(module, heads: list, mask_problem: str | None, rank: int) -> None:
    """The ranks' exchanged flags (mask accepted, batch, local length, positions given, padded, mask rows):
    a refusal on every rank alike when one rank refused its mask or the ranks' shapes differ."""
    if not all(h[0] for h in heads):  # every rank stops here: no rank goes on to the gather below
        raise _refuse(
            module,
            f"rank {rank}: {mask_problem}"
            if mask_problem is not None
            else f"rank {rank}: another rank refused its attention mask (see that rank's error)",
        )
    for i, what in (
        (2, "local lengths (tokens per rank)"),
        (1, "batch sizes of their position ids"),
        (3, "position ids (given on some ranks only)"),
        (5, "attention masks (batch size, or given on some ranks only)"),
    ):
        if len({h[i] for h in heads}) > 1:
            raise _refuse(
                module,
                f"rank {rank}: the ranks pass different {what}: "
                f"{ {r: int(h[i]) for r, h in enumerate(heads)} }. Every rank must hold S/P tokens of "
                f"the same sequences: shard them with tokenring.hf.shard_batch or tokenring.shard",
            )


def _check_inputs(
    module, attention_mask, position_ids, s: int, rank: int, P: int, layout: str, group, device, causal=True, docs=None
) -> tuple[list[int] | None, list[list[int]] | None]:
    """Mask and position checks, agreed on by all ranks (one small all-gather of the flags and position ids),
    so a problem on one rank's shard raises on every rank instead of leaving the others waiting in attention.
    Returns the documents (cu_seqlens over the global sequence) that the position ids pack, or ``None``, and
    each row's documents of real tokens and pads that a padding mask gives (:func:`_padding_documents`)."""
    mask_problem = _mask_problem(attention_mask, allow_padding=True)
    padded = mask_problem is None and attention_mask is not None and not bool(attention_mask.to(torch.bool).all())
    use_pos = position_ids is not None and position_ids.shape[-1] == s  # the caller drops unchecked ones
    # (some models pass positions of another shape, e.g. mrope: left alone)
    pos = position_ids.reshape(-1, s).to(torch.int64) if use_pos else None
    pads = None  # each row's documents of real tokens and pads
    if P == 1 and padded:
        mask_problem = _padding_problem(attention_mask)
        pads = _padding_documents(attention_mask, causal) if mask_problem is None else None
    if P > 1 and not values_travel(group):  # PyTorch's fake process group moves no values: shapes only
        if mask_problem is not None:
            raise _refuse(module, f"rank {rank}: {mask_problem}")
        return None, None
    if P > 1 and (attention_mask is not None or position_ids is not None):
        B = pos.shape[0] if pos is not None else 0
        # A fixed-size exchange first, so that what differs is named (and the variable-size one below can
        # not mismatch: gloo aborts the process on unequal sizes).
        mask_rows = attention_mask.shape[0] if isinstance(attention_mask, torch.Tensor) else -1
        local_default = pos is not None and bool((pos.cpu() == torch.arange(s)).all())
        head = [int(mask_problem is None), B, s, int(pos is not None), int(padded), mask_rows, int(local_default)]
        heads = exchange(head, group, rank, P, "the attention layers", "attention masks and position ids")
        _check_heads(module, heads, mask_problem, rank)
        if any(h[4] for h in heads):  # a padding mask on some rank: the whole batch's rows become documents
            full_mask = _gathered(attention_mask.to(torch.int64).reshape(-1, s), layout, group, device, docs)
            problem = _padding_problem(full_mask)
            if problem is not None:  # every rank derived the same from the same gathered mask
                raise _refuse(module, f"rank {rank}: {problem}")
            pads = _padding_documents(full_mask, causal)
        if pos is not None and docs is None:  # explicit documents: positions are rotary only
            full, default = _gathered(pos, layout, group, device, docs), all(h[6] for h in heads)
    elif pos is not None:
        full, default = pos.cpu(), False
    if mask_problem is not None:
        raise _refuse(module, f"rank {rank}: {mask_problem}")
    if pos is None or docs is not None:
        return None, pads
    cu, problem = _documents(full, default, s * P, layout)
    if problem is None and cu is None and P > 1:
        offset = full - torch.arange(s * P)
        if bool((offset != offset[:, :1]).any()):
            problem = (
                f"position_ids are not the global positions of this rank's tokens under layout={layout!r}. "
                f"Pass position_ids=tokenring.shard(torch.arange(S)[None], dim=1, layout={layout!r}) (or use "
                f"tokenring.hf.shard_batch); without them rotary embeddings use local positions and the "
                f"result is wrong"
            )
    if problem is not None:  # every rank derived the same from the same gathered positions
        raise _refuse(module, f"rank {rank}: {problem}")
    return cu, pads


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``attn_implementation="tokenring"``: ``query`` (B, H, s, d), ``key``/``value``
    (B, Hkv, s, d), this rank's shard; returns ``(out (B, s, H, d), None)``."""
    step = take_step(module, key)  # set when the layer's cache is a tokenring ShardedCache; taken before any refusal
    stepping = step is not None and ("new" in step[1] or "extend" in step[1])  # a step over the sharded cache
    try:
        sinks = _sinks_or_refuse(module, dropout, kwargs)
        if stepping:
            problem = step[0].owner.mask_problem(attention_mask, step[0].total)
            if problem is not None:
                raise _refuse(module, problem)
    except ValueError:
        if stepping:
            step[0].undo()  # a refused step leaves the cache as it was (a refusal comes at the first layer)
        raise
    if stepping:
        step[0].commit()  # not refused: the K/V before this step need not be kept (they would double the cache)
    s = query.shape[2]
    if not torch.compiler.is_compiling():
        model = _mixers.model_on_stack(module)
        if model is None or _checked() is not model:  # (mask_forward checked this forward's model already)
            check_ddp(_settings_group(), model)
            _check_mixers(module, f"tokenring ({_where(module)})")
    if stepping:
        window = kwargs.get("sliding_window")  # transformers: query i sees keys j with i - W < j <= i
        window = window - 1 if window is not None and step[0].total > window else None
        return step_attention(*step, query, key, value, scaling, sinks, window), None
    if key.shape[2] != s:
        raise _refuse(
            module,
            f"keys ({key.shape[2]} tokens) and queries ({s}) differ in length: a KV cache holds "
            f"earlier tokens (decoding). Prefill with tokenring.hf.prefill(model, input_ids) "
            f"and pass its cache to model.generate (a sharded cache), or pass use_cache=False",
        )
    group = _settings.group
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    layout = layer_layout(s, kwargs.get("cu_seq_lens_q"))
    cu = _cu_seqlens(module, attention_mask, s, causal, kwargs, layout)
    window = kwargs.get("sliding_window")
    # transformers' sliding layers: key j is visible from query i when i - W < j (and j <= i when causal)
    window = (window - 1, 0 if causal else window - 1) if window is not None else None
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    extra = _settings.config_fn(module) if _settings.config_fn is not None else None
    kw = dict(
        causal=causal, softmax_scale=scaling, strategy=_settings.strategy, layout=layout, window=window,
        sinks=sinks, group=group, inner_size=_settings.inner_size,
    )  # fmt: skip
    with instrument(**extra) if extra else contextlib.nullcontext():
        out = _attend_rows(module, q, k, v, cu, kw)
    return out, None


_row_groups = IdentityCache()


def _attend_rows(module, q, k, v, cu, kw: dict) -> torch.Tensor:
    """:func:`tokenring.attention` of a batch whose rows may have documents of their own (``cu``: one row of
    :func:`hf_documents` per batch row, or one for all): one call per group of rows that share documents (one
    per row under ``torch.compile``, which cannot compare values), the rows put back in order."""
    if cu is None:
        return attention(q, k, v, **kw)
    if cu.shape[0] not in (1, q.shape[0]):
        raise _refuse(module, f"the attention mask has {cu.shape[0]} rows but the batch {q.shape[0]}")
    compiling = torch.compiler.is_compiling()
    groups = None if compiling else _row_groups.get([cu])
    if groups is None:  # rows (views of cu, kept: the layers share them, and the masks made from them)
        groups = [(list(range(q.shape[0])), cu[0])] if cu.shape[0] == 1 else []
        for b in range(q.shape[0] if cu.shape[0] > 1 else 0):
            same = None if compiling else next((g for g in groups if torch.equal(cu[b], g[1])), None)
            if same is None:
                groups.append(([b], cu[b]))
            else:
                same[0].append(b)
        if not compiling:
            _row_groups.put([cu], groups)
    if len(groups) == 1:
        return attention(q, k, v, cu_seqlens=groups[0][1], **kw)
    parts = [attention(q[idx], k[idx], v[idx], cu_seqlens=row, **kw) for idx, row in groups]
    order = torch.tensor([b for idx, _ in groups for b in idx], device=q.device)
    return torch.cat(parts).index_select(0, torch.argsort(order))


def _sinks_or_refuse(module, dropout: float, kwargs: dict):
    """The layer's attention-sink logits (or ``None``); a refusal for options the engine does not run."""
    if kwargs.get("softcap") is not None:
        raise _refuse(module, "logit soft-capping (softcap) is not supported; use a model without it")
    sinks = kwargs.get("s_aux")  # gpt-oss passes its per-head sink logits so
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    if kwargs.get("position_bias") is not None:
        raise _refuse(module, "an additive position bias is not supported")
    if dropout:
        raise _refuse(module, f"attention dropout {dropout} is not supported; set config.attention_dropout = 0")
    if kwargs.get("output_attentions"):
        warnings.warn("tokenring never materialises attention weights; output_attentions returns None", stacklevel=3)
    return sinks


def _cu_seqlens(module, attention_mask, s: int, causal: bool, kwargs: dict, layout: str):
    """The global ``cu_seqlens`` of the documents in this batch (positions, mask or HF's own), or ``None``."""
    pos = kwargs.get("position_ids")
    pos = pos if isinstance(pos, torch.Tensor) and pos.shape[-1] == s and _settings.check_positions else None
    cu_q, cu_k = (_as_tensor(kwargs.get(name)) for name in ("cu_seq_lens_q", "cu_seq_lens_k"))
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise _refuse(module, _mask_problem(attention_mask))
    if attention_mask is None and pos is None and cu_q is None:
        return None
    args = (pos, attention_mask, cu_q, cu_k, s, layout, _group_name(_settings.group), _where(module), causal)
    if _plain_eager(pos, attention_mask, cu_q, cu_k):  # the op's body without its dispatch (as tokenring.ops does)
        return hf_documents._init_fn(*args)
    return hf_documents(*args)


def layer_layout(s: int, cu_q) -> str:
    """The layout a layer's shard was cut with: the setting, or for ``"auto"`` the placement
    :func:`tokenring.hf.shard_batch` chose from the documents it passes as ``cu_seq_lens_q`` (none: zigzag)."""
    P = group_info(_settings.group)[1]
    return placed_layout(_settings.layout, s * P, P, cu_q)


def _as_tensor(x):
    return x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(x)


_documents_cache = IdentityCache()


@torch.library.custom_op("tokenring::hf_documents", mutates_args=())
def hf_documents(
    position_ids: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    cu_q: Optional[torch.Tensor],
    cu_k: Optional[torch.Tensor],
    s: int,
    layout: str,
    group: str,
    where: str,
    causal: bool = True,
) -> torch.Tensor:
    """The documents (``cu_seqlens`` over the global sequence, padded with ``S`` to ``S + 1`` entries: a fixed
    shape for ``torch.compile``; one row per batch row of a padding mask, :func:`_rows`) that a layer's mask,
    position ids or explicit ``cu_seq_lens_q`` give, checked
    on every rank alike (:func:`_check_inputs`). Once per distinct input: the layers of one forward share the
    tensors, so only the first gathers and reads values."""
    inputs = [position_ids, attention_mask, cu_q, cu_k]
    hit = _documents_cache.get(inputs)
    if hit is not None and hit[0] == (s, layout, group, causal):
        return hit[1]
    grp = resolve_group(group)
    rank, P = group_info(grp)
    if P > 1:
        _check_mixers(None, f"tokenring ({where})")  # compiled models reach the check here, not in the layer
    device = collective_device(grp) if P > 1 else "cpu"
    if cu_q is not None and cu_k is not None and not torch.equal(cu_k.cpu(), cu_q.cpu()):
        raise _refuse(where, "cu_seq_lens_q and cu_seq_lens_k differ; packed self-attention needs one packing")
    docs = cu_q.cpu().tolist() if cu_q is not None else None  # explicit documents (shard_batch)
    if layout in DOCUMENT_LAYOUTS and docs is None and P > 1:
        raise _refuse(
            where,
            f"layout={layout!r} places tokens by document, but this batch gives no cu_seq_lens_q: shard it "
            f"with tokenring.hf.shard_batch (or SequenceParallel.shard_batch), which passes them",
        )
    cu, pads = _check_inputs(where, attention_mask, position_ids, s, rank, P, layout, grp, device, causal, docs)
    if pads is not None and layout in DOCUMENT_LAYOUTS:
        raise _refuse(
            where,
            f"layout={layout!r} places tokens by the packed documents, so padding cannot add documents of its "
            f"own: pack the rows without padding (DataCollatorWithFlattening), or use layout='zigzag'",
        )
    S = s * P
    cu = [0, S] if (docs if docs is not None else cu) is None else list(docs if docs is not None else cu)
    out = torch.full((_rows(attention_mask), S + 1), S, dtype=torch.int64)
    for r, row in enumerate(out):
        both = cu if pads is None else sorted(set(cu) | set(pads[r]))
        row[: len(both)] = torch.tensor(both[: S + 1], dtype=torch.int64)
    _documents_cache.put(inputs, ((s, layout, group, causal), out))
    return out


def _rows(attention_mask) -> int:
    """Rows of :func:`hf_documents`' answer: one per row of a padding mask (each row its own documents), else 1."""
    return attention_mask.shape[0] if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else 1


@hf_documents.register_fake
def _(position_ids, attention_mask, cu_q, cu_k, s, layout, group, where, causal=True):
    given = next((t for t in (position_ids, attention_mask, cu_q) if t is not None), None)
    if given is not None and _pretended_meta(given):  # tokenring.testing.pretend_cuda: run the real one
        return hf_documents._init_fn(position_ids, attention_mask, cu_q, cu_k, s, layout, group, where, causal)
    return torch.empty(_rows(attention_mask), s * group_info(resolve_group(group))[1] + 1, dtype=torch.int64)


def _context():
    """The group and layout of a sharded forward, for the sequence mixers' hooks (:mod:`tokenring.mixers`)."""
    return _settings.group, _settings.layout


def prepare(model: torch.nn.Module, mixers: str = "state_passing") -> None:
    """Make ``model``'s layers that mix tokens outside attention (Gated DeltaNet, Mamba2, short convolutions:
    :mod:`tokenring.mixers`) exact when sharded. ``mixers="state_passing"`` (the default): each rank runs its
    own rows and the ranks exchange recurrent states and convolution halos (:mod:`tokenring.recurrence`); a
    model with a kind it does not cover is refused. ``mixers="replicate"``: every such layer runs on the whole
    sequence on every rank (any kind; P times the work). Done by the model's first forward on its own (its
    attention mask goes through :func:`mask_forward`); call it before that forward for ``"replicate"``, before
    ``torch.compile``, or for a model that builds no mask. Every rank of the group calls it."""
    _mixers.prepare(model, _context, group_info(_settings.group)[1], "tokenring.hf.prepare", mixers)


def _check_mixers(layer, who: str) -> None:
    """At an attention layer or the documents op: the running model's sequence mixers were prepared."""
    P = group_info(_settings.group)[1]
    if P > 1:
        model = _mixers.model_on_stack(layer)
        if model is not None:
            _mixers.check_prepared(model, P, who)


def mask_forward(*, attention_mask=None, **kwargs):
    """The mask function registered for ``attn_implementation="tokenring"``: builds nothing (a causal mask
    built from local positions would be wrong for a sharded sequence, and an ``S x S`` one would cost memory
    for nothing) and hands the user's 2D padding mask (or ``None``) through to :func:`attention_forward`, which
    accepts an all-ones mask and refuses any other. Without a registered mask function transformers would
    silently drop a padding mask. Called at the start of the model's forward, before any layer: the place to
    prepare the model's sequence mixers (:func:`prepare`) and to drop cache steps a failed call left."""
    if not torch.compiler.is_compiling():
        forget_steps()
        P = group_info(_settings.group)[1]
        model = _mixers.model_on_stack(config=kwargs.get("config"))  # (P = 1 too: packed documents)
        global _checked
        _checked = _nobody
        if model is not None:
            _mixers.prepare(model, _context, P, "tokenring")
            check_ddp(_settings_group(), model)
            _checked = weakref.ref(model)  # its layers skip these checks in this forward (one scan, not one a layer)
    return attention_mask


def _nobody():
    return None


_checked = _nobody  # a weak reference to the model whose forward mask_forward has checked


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` as ``attn_implementation=name`` and :func:`mask_forward` as its mask
    function (done on import)."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)


register()
