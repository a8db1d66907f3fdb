"""Hugging Face ``transformers`` integration: run a causal LM (or any model whose attention goes through
``transformers.AttentionInterface``) over a sequence sharded across ranks.

    import tokenring.hf                                   # registers attn_implementation="tokenring"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tokenring")   # or from_pretrained(path, ...)
    batch = tokenring.hf.shard_batch(input_ids, labels=input_ids)   # full tensors in, this rank's shard out
    out = model(**batch)                                  # this rank's logits; out.loss = local part of the mean
    logits = tokenring.hf.gather_logits(out.logits)       # (B, S, V), every rank
    out.loss.backward(); tokenring.hf.all_reduce_grads(model)     # now equal to single-process gradients
    loss = tokenring.hf.reduce_loss(out.loss)             # the global mean loss (for logging)

Every attention layer then calls :func:`tokenring.attention` on this rank's shard. The plain path works too:
shard ``input_ids`` and ``position_ids`` yourself with ``tokenring.shard(..., dim=1, layout="zigzag")`` and
call ``model(input_ids=local_ids, position_ids=local_pos)``. **Pass the global positions**: without
``position_ids`` transformers numbers the local tokens ``0..s-1`` and rotary embeddings would be wrong, so
that case is refused.

Strategy, layout and process group come from :func:`configure` (process-wide) or the :func:`settings` context
manager; defaults: ``strategy="auto"``, ``layout="zigzag"``, the default process group.

Any batch length: :func:`shard_batch` pads a length that does not split over the layout with a few trailing
pad tokens of their own document, without targets (:func:`gather_logits` ``length=`` drops their rows).

What works (tested: 44 decoder configs, ``tests/family_cases.py``; hybrids' linear-attention, Mamba and
convolution layers through :mod:`tokenring.mixers`): decoder-only models
whose attention layers call ``ALL_ATTENTION_FUNCTIONS`` with causal (``module.is_causal``) or bidirectional
attention and no attention bias, including

- packed batches: ``position_ids`` restarting at 0 for each document (``DataCollatorWithFlattening``; pass
  them to :func:`shard_batch` as ``position_ids``), read the way transformers reads them (a new document
  wherever a position is not the previous one plus 1), or explicit ``cu_seq_lens_q`` over the global sequence;
  documents attend only within themselves (:func:`tokenring.attention`'s ``cu_seqlens``);
- sliding-window layers (Mistral, Qwen2, Gemma's sliding layers): transformers' window (query ``i`` sees keys
  ``i - W < j <= i``) as ``tokenring.attention(window=(W - 1, 0))``.

What is refused, with a ``ValueError`` that says why:

- custom masks: a 4D mask, or a 2D ``attention_mask`` that pads on the left or leaves holes, or pads at all
  under bidirectional attention (right padding under causal attention is accepted: no real token sees a
  later pad; pack the rows instead, or pad on the right);
- position ids that are not the global positions of the local tokens (e.g. omitted ``position_ids``), and
  batch rows that pack different documents;
- logit soft-capping (Gemma 2), position biases (T5-style);
- attention dropout > 0 (set ``config.attention_dropout = 0``);
- a regular KV cache holding earlier tokens; decode with :func:`prefill`'s sharded cache instead
  (``model.generate(input_ids, cache=tokenring.hf.prefill(model, input_ids))``, see :mod:`tokenring.hf_cache`);
- ``output_attentions=True`` (the weights are never materialised; ``None`` is returned with a warning).

Not detected: models that overlay their own mask functions on the causal mask (e.g. bidirectional image-token
blocks in some vision-language models) would silently get plain causal attention; do not use them here.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import mixers
from .api import _group_name, attention
from .comm import collective_device
from .instrument import instrument
from .layouts import check_layout, gather, group_info, local_positions, shard
from .ops import IdentityCache
from .strategies import get as get_strategy
from .strategies import node_size
from .training import check_ddp

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tokenring.hf needs transformers: pip install 'tokenring-attn[hf]'") from e

from .hf_cache import ShardedCache, forget_steps, step_attention, take_step  # noqa: E402  (needs transformers)

__all__ = [
    "NAME",
    "register",
    "configure",
    "settings",
    "attention_forward",
    "shard_batch",
    "gather_logits",
    "reduce_loss",
    "all_reduce_grads",
    "shift_labels",
    "prefill",
    "extend",
    "prepare",
    "ShardedCache",
    "causal_lm_loss",
    "SequenceParallelTrainer",  # noqa: F822 (module __getattr__, imports transformers.Trainer when asked)
]

NAME = "tokenring"
IGNORE_INDEX = -100
# extend with strategy "auto" runs at most this many new tokens per rank replicated, as a decode step: sharding
# them cost 0.89x at T=16 on 4 ranks and won from T=128 (bench/results/extend.md)
REPLICATE_PER_RANK = 4


@dataclass
class _Settings:
    strategy: str = "auto"
    layout: str = "zigzag"
    group: object = None
    check_positions: bool = True
    inner_size: int | None = None  # ranks per node for the hierarchical strategies (None: $LOCAL_WORLD_SIZE)
    config_fn: object = None  # private: module -> tokenring.instrument() fields for its call (tracing), or None


_settings = _Settings()


def configure(
    strategy: str | None = None,
    layout: str | None = None,
    group=None,
    check_positions: bool | None = None,
    inner_size: int | None = None,
) -> None:
    """Set the strategy (``"auto"``, ``"token_ring"``, ``"ring"``, ``"ulysses"``, ``"ring_bidir"`` or a variant
    such as ``"token_ring:direct,c=2,k=3"``), the layout the inputs were
    sharded with (``"zigzag"`` default, or ``"contiguous"``) and the process group used by every attention
    layer of models with ``attn_implementation="tokenring"``; ``inner_size``: ranks per node for the
    hierarchical strategies (``"usp"``, ``"double_ring"``, ``"token_ring_2d"``; default ``$LOCAL_WORLD_SIZE``).
    Arguments left ``None`` keep their value."""
    if inner_size is not None:
        node_size(inner_size)  # a positive number of ranks per node, or a ValueError saying so
    if strategy is not None:
        if strategy != "auto":
            get_strategy(strategy)  # unknown names and malformed variants fail here, with what is accepted
        _settings.strategy = strategy
    if layout is not None:
        check_layout(layout)
        _settings.layout = layout
    if group is not None:
        _settings.group = group
    if check_positions is not None:
        _settings.check_positions = bool(check_positions)
    if inner_size is not None:
        _settings.inner_size = int(inner_size)


@contextlib.contextmanager
def settings(**kw):
    """``with tokenring.hf.settings(strategy="ring"): model(...)`` — :func:`configure` for a block only."""
    old = _Settings(**vars(_settings))
    try:
        configure(**kw)
        yield _settings
    finally:
        _settings.__dict__.update(vars(old))


def _where(module) -> str:
    layer = getattr(module, "layer_idx", None)
    return f"layer {layer}" if layer is not None else type(module).__name__


def _refuse(module, why: str) -> ValueError:
    where = module if isinstance(module, str) else _where(module)
    return ValueError(f"tokenring (attn_implementation='tokenring', {where}): {why}")


def _mask_problem(attention_mask, allow_padding: bool = False) -> str | None:
    """What cannot be sharded about ``attention_mask`` (``None``: nothing). ``allow_padding``: a 2D padding mask
    passes here; whether it pads on the right, which causal layers never see, is checked on the whole batch."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        return (
            f"got an attention mask of type {type(attention_mask).__name__}; only full causal or full "
            f"bidirectional attention can be sharded (pass attention_mask=None)"
        )
    if attention_mask.dim() == 2 and (allow_padding or bool(attention_mask.to(torch.bool).all())):
        return None  # all ones means no padding
    return (
        f"got an attention mask of shape {tuple(attention_mask.shape)} that masks tokens (padding or a "
        f"custom mask). TokenRing computes exact full causal/bidirectional attention over the sharded sequence "
        f"and cannot express padding masks: pass unpadded sequences of one length with attention_mask=None"
    )


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
            f"pass cu_seq_lens_q (shard_batch does)"
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


def _padding_problem(full_mask: torch.Tensor, causal: bool) -> str | None:
    """A whole batch's 2D mask (B, S): right padding under causal attention is fine (no real token sees a later
    pad, and the pads carry no loss); anything else is refused."""
    m = full_mask.to(torch.bool)
    if bool(m.all()):
        return None
    if bool((m[:, 1:] & ~m[:, :-1]).any()):
        return (
            "the attention mask has padding before real tokens (left padding) or holes; only right padding can be "
            "sharded: pad on the right (tokenizer.padding_side = 'right'), or pack the rows without padding "
            "(DataCollatorWithFlattening)"
        )
    if not causal:
        return (
            "the attention mask pads rows on the right, but this layer attends bidirectionally, so real tokens "
            "would see the pads; pack the rows without padding (DataCollatorWithFlattening) instead"
        )
    return None


def _check_inputs(
    module, attention_mask, position_ids, s: int, rank: int, P: int, layout: str, group, device, causal: bool = True
) -> list[int] | None:
    """Mask and position checks, agreed on by all ranks (one small all-gather of the flags and position ids),
    so a problem on one rank's shard raises on every rank instead of leaving the others waiting in attention.
    Returns the documents (cu_seqlens over the global sequence) that the position ids pack, or ``None``."""
    mask_problem = _mask_problem(attention_mask, allow_padding=True)
    padded = mask_problem is None and attention_mask is not None and not bool(attention_mask.to(torch.bool).all())
    use_pos = position_ids is not None and position_ids.shape[-1] == s  # the caller drops unchecked ones
    # (some models pass positions of another shape, e.g. mrope: left alone)
    pos = position_ids.reshape(-1, s).to(torch.int64) if use_pos else None
    if P == 1 and padded:
        mask_problem = _padding_problem(attention_mask, causal)
    if P > 1 and (attention_mask is not None or position_ids is not None):
        B = pos.shape[0] if pos is not None else 0
        # A fixed-size exchange first, so that what differs is named (and the variable-size one below can
        # not mismatch: gloo aborts the process on unequal sizes).
        mask_rows = attention_mask.shape[0] if isinstance(attention_mask, torch.Tensor) else -1
        head = torch.tensor(
            [int(mask_problem is None), B, s, int(pos is not None), int(padded), mask_rows], dtype=torch.int64
        )
        heads = [torch.empty_like(head, device=device) for _ in range(P)]
        dist.all_gather(heads, head.to(device), group=group)
        heads = [h.cpu().tolist() for h in heads]
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
                    f"{ {r: h[i] for r, h in enumerate(heads)} }. Every rank must hold S/P tokens of "
                    f"the same sequences: shard them with tokenring.hf.shard_batch or tokenring.shard",
                )
        if any(h[4] for h in heads):  # a padding mask on some rank: is it right padding of the whole batch?
            mine = attention_mask.to(torch.int64).reshape(-1).to(device)  # every rank has one of the same size
            every = [torch.empty_like(mine) for _ in range(P)]
            dist.all_gather(every, mine, group=group)
            order = torch.argsort(torch.cat([local_positions(s * P, P, r, layout) for r in range(P)]))
            full_mask = torch.cat([e.view(-1, s).cpu() for e in every], dim=1).index_select(1, order)
            problem = _padding_problem(full_mask, causal)
            if problem is not None:  # every rank derived the same from the same gathered mask
                raise _refuse(module, f"rank {rank}: {problem}")
        if pos is not None:
            mine = pos.reshape(-1).to(device)
            every = [torch.empty_like(mine) for _ in range(P)]
            dist.all_gather(every, mine, group=group)
            local = [e.view(B, s).cpu() for e in every]
            order = torch.argsort(torch.cat([local_positions(s * P, P, r, layout) for r in range(P)]))
            full = torch.cat(local, dim=1).index_select(1, order)
            default = all(bool((t == torch.arange(s)).all()) for t in local)
    elif pos is not None:
        full, default = pos.cpu(), False
    if mask_problem is not None:
        raise _refuse(module, f"rank {rank}: {mask_problem}")
    if pos is None:
        return None
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
    return cu


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
        warnings.warn("tokenring never materialises attention weights; output_attentions returns None", stacklevel=2)
    s = query.shape[2]
    if not torch.compiler.is_compiling():
        check_ddp(_settings.group if _settings.group is not None else dist.group.WORLD, mixers.model_on_stack(module))
        _check_mixers(module, f"tokenring ({_where(module)})")
    if step is not None and ("new" in step[1] or "extend" in step[1]):  # a step over the sharded cache
        problem = _mask_problem(attention_mask)
        if problem is not None:
            raise _refuse(module, problem)
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
    rank, P = group_info(group)
    pos = kwargs.get("position_ids")
    pos = pos if isinstance(pos, torch.Tensor) and pos.shape[-1] == s and _settings.check_positions else None
    cu_q, cu_k = (_as_tensor(kwargs.get(name)) for name in ("cu_seq_lens_q", "cu_seq_lens_k"))
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise _refuse(module, _mask_problem(attention_mask))
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    cu = None
    if attention_mask is not None or pos is not None or cu_q is not None:
        cu = hf_documents(
            pos, attention_mask, cu_q, cu_k, s, _settings.layout, _group_name(group), _where(module), causal
        )
    window = kwargs.get("sliding_window")
    # transformers' sliding layers: key j is visible from query i when i - W < j (and j <= i when causal)
    window = (window - 1, 0 if causal else window - 1) if window is not None else None
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    extra = _settings.config_fn(module) if _settings.config_fn is not None else None
    with instrument(**extra) if extra else contextlib.nullcontext():
        out = attention(
            q,
            k,
            v,
            causal=causal,
            softmax_scale=scaling,
            strategy=_settings.strategy,
            layout=_settings.layout,
            cu_seqlens=cu,
            window=window,
            sinks=sinks,
            group=group,
            inner_size=_settings.inner_size,
        )
    return out, None


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
    shape for ``torch.compile``) that a layer's mask, position ids or explicit ``cu_seq_lens_q`` give, checked
    on every rank alike (:func:`_check_inputs`). Once per distinct input: the layers of one forward share the
    tensors, so only the first gathers and reads values."""
    inputs = [position_ids, attention_mask, cu_q, cu_k]
    hit = _documents_cache.get(inputs)
    if hit is not None and hit[0] == (s, layout, group, causal):
        return hit[1]
    from .ops import resolve_group

    grp = resolve_group(group)
    rank, P = group_info(grp)
    if P > 1:
        _check_mixers(None, f"tokenring ({where})")  # compiled models reach the check here, not in the layer
    device = collective_device(grp) if P > 1 else "cpu"
    cu = _check_inputs(where, attention_mask, position_ids, s, rank, P, layout, grp, device, causal)
    if cu_q is not None:  # explicit documents (shard_batch, DataCollatorWithFlattening)
        if cu_k is not None and not torch.equal(cu_k.cpu(), cu_q.cpu()):
            raise _refuse(where, "cu_seq_lens_q and cu_seq_lens_k differ; packed self-attention needs one packing")
        cu = cu_q.cpu().tolist()
    S = s * P
    cu = [0, S] if cu is None else list(cu)
    out = torch.full((S + 1,), S, dtype=torch.int64)
    out[: len(cu)] = torch.tensor(cu[: S + 1], dtype=torch.int64)
    _documents_cache.put(inputs, ((s, layout, group, causal), out))
    return out


@hf_documents.register_fake
def _(position_ids, attention_mask, cu_q, cu_k, s, layout, group, where, causal=True):
    from .ops import resolve_group

    return torch.empty(s * group_info(resolve_group(group))[1] + 1, dtype=torch.int64)


def _context():
    """The group and layout of a sharded forward, for the sequence mixers' hooks (:mod:`tokenring.mixers`)."""
    return _settings.group, _settings.layout


def prepare(model: torch.nn.Module) -> None:
    """Make ``model``'s layers that mix tokens outside attention (linear attention, Mamba, short convolutions:
    :mod:`tokenring.mixers`) exact when sharded: each runs on the whole sequence, gathered from the ranks.
    Done by the model's first forward on its own (its attention mask goes through :func:`mask_forward`);
    call it before ``torch.compile`` or for a model that builds no mask. Every rank of the group calls it."""
    mixers.prepare(model, _context, group_info(_settings.group)[1], "tokenring.hf.prepare")


def _check_mixers(layer, who: str) -> None:
    """At an attention layer or the documents op: the running model's sequence mixers were prepared."""
    P = group_info(_settings.group)[1]
    if P > 1:
        model = mixers.model_on_stack(layer)
        if model is not None:
            mixers.check_prepared(model, P, who)


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
        model = mixers.model_on_stack(config=kwargs.get("config")) if P > 1 else None
        if model is not None:
            mixers.prepare(model, _context, P, "tokenring")
    return attention_mask


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` as ``attn_implementation=name`` and :func:`mask_forward` as its mask
    function (done on import)."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)


register()


# ----------------------------------------------------------------------------------------------------------------
# Batches, loss, gradients


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets on the *full* sequence: ``out[:, i] = labels[:, i + 1]``, last = ``ignore_index``.
    Shift first, then shard: under zigzag the next token of a rank's last local token lives on another rank."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    layout: str | None = None,
    group=None,
    ignore_index: int = IGNORE_INDEX,
    verify: bool = False,
    _scaled: bool = False,
) -> dict:
    """This rank's shard of a batch given as full ``(B, S)`` tensors (identical on every rank), ready for
    ``model(**batch)``.

    Returns ``input_ids``, ``position_ids`` (the global positions of the local tokens, so rotary embeddings are
    right), ``use_cache=False`` and, with ``labels`` (transformers convention: unshifted, ``-100`` ignored),
    ``labels``/``shift_labels`` = the global next-token targets of the local tokens (shifted on the full
    sequence, then sharded: transformers does not shift them again) and ``num_items_in_batch`` = the global
    number of targets, so ``model(**batch).loss`` is this rank's share of the global mean and the shares sum
    to it (:func:`reduce_loss`). An ``attention_mask`` must be all ones (padding cannot be expressed).
    ``verify``: compare a checksum of the full inputs across the group first (one small all-gather; every
    rank must call it): ranks holding different samples, what a per-rank data sampler gives, raise a
    ValueError on every rank instead of training on a garbled sequence.
    """
    from .training import active

    if active() is not None and not _scaled:
        raise ValueError(
            "tokenring.hf.shard_batch: a tokenring.training.SequenceParallel is active; use its "
            "shard_batch (the loss is scaled there for DDP/FSDP's average over every rank)"
        )
    layout = layout or _settings.layout
    group = group if group is not None else _settings.group
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected the full (batch, seq) tensor")
    B, S = input_ids.shape
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(
                f"tokenring.hf.shard_batch: attention_mask {tuple(attention_mask.shape)} and input_ids {(B, S)} "
                f"differ in shape"
            )
        problem = _padding_problem(attention_mask, causal=True)
        if problem is not None:
            raise ValueError(f"tokenring.hf.shard_batch: {problem}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
    if verify:
        from .training import same_batch

        same_batch(
            group if group is not None else dist.group.WORLD,
            [t for t in (input_ids, labels, position_ids) if t is not None],
        )
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    input_ids, labels, position_ids, attention_mask = _pad_length(
        input_ids, labels, position_ids, attention_mask, layout, group, ignore_index
    )
    out = dict(
        input_ids=shard(input_ids, dim=1, layout=layout, group=group),
        position_ids=shard(position_ids, dim=1, layout=layout, group=group),
        use_cache=False,
    )
    if attention_mask is not None and not bool(attention_mask.to(torch.bool).all()):
        out["attention_mask"] = shard(attention_mask, dim=1, layout=layout, group=group)  # checked by the layers
    if labels is not None:
        targets = shift_labels(labels, ignore_index)
        local = shard(targets, dim=1, layout=layout, group=group).contiguous()
        out.update(
            labels=local, shift_labels=local, num_items_in_batch=(targets != ignore_index).sum().to(input_ids.device)
        )
    return out


def _pad_length(input_ids, labels, position_ids, attention_mask, layout: str, group, ignore_index: int):
    """Any length: a batch whose length does not split over the layout (``2P`` chunks for zigzag) gets a few
    pad tokens at the end, as a document of their own (position ids restarting at 0), with no targets. No real
    token sees them: causal attention looks back only, and documents attend within themselves. The model's
    outputs then have those few extra rows at the end (:func:`gather_logits` with ``length=`` drops them)."""
    P = group_info(group)[1]
    if layout == "zigzag_docs":
        return input_ids, labels, position_ids, attention_mask  # its documents must split: local_positions says so
    pad = -input_ids.shape[1] % (2 * P if layout.startswith("zigzag") else P)
    if not pad:
        return input_ids, labels, position_ids, attention_mask
    B = input_ids.shape[0]
    grow = lambda t, value: torch.nn.functional.pad(t, (0, pad), value=value)
    extra = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype).expand(B, pad)
    return (
        grow(input_ids, 0),
        grow(labels, ignore_index) if labels is not None else None,
        torch.cat([position_ids.expand(B, -1), extra], dim=1),
        grow(attention_mask, 0) if attention_mask is not None else None,
    )


def gather_logits(
    logits: torch.Tensor, layout: str | None = None, group=None, length: int | None = None
) -> torch.Tensor:
    """The full ``(B, S, V)`` logits on every rank from each rank's ``(B, s, V)`` (not differentiable);
    ``length``: the batch's length before :func:`shard_batch` padded it to split evenly (drops the pad rows)."""
    full = gather(
        logits.detach(), dim=1, layout=layout or _settings.layout, group=group if group is not None else _settings.group
    )
    return full if length is None else full[:, :length]


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of the ranks' loss shares (from ``model(**shard_batch(...)).loss``): the global mean loss, every rank.
    Detached: backpropagate the local share, then :func:`all_reduce_grads`."""
    group = group if group is not None else _settings.group
    total = loss.detach().clone()
    if group_info(group)[1] > 1:
        dist.all_reduce(total, group=group)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 shards parameters and gradients over its mesh), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def _ranks(group) -> set:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _check_reduction(model, group) -> None:
    """Refuse a sum over ``group`` that would count a gradient twice or sum over data-parallel ranks."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "tokenring.hf.all_reduce_grads: the model is in DDP, which already reduces its "
            "gradients; use tokenring.training.SequenceParallel (its loss is scaled for DDP over "
            "all ranks) instead of also summing here"
        )
    mine = _ranks(group)
    tokenring_group = _ranks(_settings.group)
    if not mine <= tokenring_group:
        raise ValueError(
            f"tokenring.hf.all_reduce_grads sums gradients over the ranks that share a sequence (the "
            f"tokenring group {sorted(tokenring_group)}), but group= has ranks {sorted(mine)}: with "
            f"data parallelism that sums the data-parallel ranks' gradients too (dp times the true "
            f"gradient). Sum over the cp group only and let DDP/FSDP average over dp, or use "
            f"tokenring.training.SequenceParallel"
        )
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "device_mesh"):
            shared = set()
            for dim in range(g.device_mesh.ndim):
                shared |= _ranks(g.device_mesh.get_group(dim)) & mine
            if len(shared) > 1:
                raise ValueError(
                    "tokenring.hf.all_reduce_grads: FSDP already reduces these gradients over ranks "
                    f"{sorted(shared)} of the tokenring group; shard the model over dp only "
                    "(fully_shard(model, mesh=mesh['dp'])), or use FSDP over all ranks with "
                    "tokenring.training.SequenceParallel and no all_reduce_grads"
                )
            break


def all_reduce_grads(model: torch.nn.Module, group=None, bucket_bytes: int = 32 << 20) -> None:
    """Sum every parameter's ``.grad`` over the ranks (in place), after ``loss.backward()`` on each rank's
    loss share: the result equals the single-process gradient of the global mean loss. Gradients are
    flattened into buckets of about ``bucket_bytes`` per collective; parameters without a gradient on this
    rank get zeros first (every rank must join the same collectives)."""
    group = group if group is not None else _settings.group
    if group_info(group)[1] == 1:
        return
    _check_reduction(model, group)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets, cur, size = [], [], 0
    for p in params:
        g = _local(p.grad)
        key = (g.dtype, g.device)
        if cur and (size + g.numel() * g.element_size() > bucket_bytes or key != cur[0][0]):
            buckets.append(cur)
            cur, size = [], 0
        cur.append((key, p))
        size += g.numel() * g.element_size()
    if cur:
        buckets.append(cur)
    for bucket in buckets:
        grads = [_local(p.grad) for _, p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@contextlib.contextmanager
def tiled_loss(model: torch.nn.Module, chunk: int = 2048):
    """Inside this block, ``model(**batch).loss`` (a ``...ForCausalLM``, bare or wrapped in DDP/FSDP) runs the
    language-model head and the loss ``chunk`` tokens at a time (:func:`tokenring.loss.chunked_cross_entropy`):
    the same loss and gradients, never the ``(tokens, vocab)`` logits. It happens inside the model's forward, so
    DDP and FSDP see the head used as usual. ``out.logits`` then holds the final hidden states (the head runs in
    the loss); the backward may run after the block."""
    from .loss import chunked_cross_entropy

    inner = getattr(model, "module", model)  # DDP and the like wrap the model
    if getattr(inner.config, "final_logit_softcapping", None):
        raise ValueError("tokenring.hf.tiled_loss: final logit soft-capping is not supported")
    head = inner.get_output_embeddings()
    real = head.forward  # with accelerate's hooks, if it put them there: the loss calls them per chunk
    own = head.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) to put back after
    old = inner.__dict__.get("_loss_function")

    def loss_function(
        logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX, shift_labels=None, **kwargs
    ):
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return chunked_cross_entropy(
            logits,
            real,
            shift_labels.to(logits.device),
            chunk=chunk,
            ignore_index=ignore_index,
            num_items=num_items_in_batch,
        )

    head.forward = lambda h: h  # the model's forward hands the hidden states to the loss
    inner.loss_function = loss_function
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
        if old is None:
            inner.__dict__.pop("_loss_function", None)
        else:
            inner.loss_function = old


def causal_lm_loss(model: torch.nn.Module, batch: dict, *, chunk: int = 2048) -> torch.Tensor:
    """``model(**batch).loss`` with the head and the loss tiled over ``chunk`` tokens (:func:`tiled_loss`):
    this rank's share of the global mean loss for a batch from :func:`shard_batch` (or a
    :class:`tokenring.training.SequenceParallel`'s), with the same value and gradients and without the
    ``(tokens, vocab)`` logits."""
    with tiled_loss(model, chunk):
        return model(**batch).loss


def __getattr__(name: str):
    if name == "SequenceParallelTrainer":  # imports transformers.Trainer (and accelerate) only when asked for
        from .hf_trainer import SequenceParallelTrainer

        return SequenceParallelTrainer
    raise AttributeError(name)


def prefill(model, input_ids: torch.Tensor, group=None, layout: str | None = None) -> ShardedCache:
    """Run the prompt ``input_ids`` (B, S) -- the full prompt, the same on every rank -- sharded over the ranks
    and return the :class:`ShardedCache` of this rank's K/V rows, ready for ``model.generate(input_ids,
    cache=cache)``. Any ``S``: the largest part that splits over the layout (``2P`` chunks for
    zigzag) is prefilled sharded with :func:`tokenring.attention`, the few tokens left as one decode step."""
    group = group if group is not None else _settings.group
    rank, P = group_info(group)
    mixers.refuse_generation(model, P, "tokenring.hf.prefill")
    if input_ids.dim() != 2:
        raise ValueError(
            f"tokenring.hf.prefill: input_ids has shape {tuple(input_ids.shape)}; expected the full "
            f"(batch, seq) prompt, the same on every rank"
        )
    _same_everywhere(input_ids, group, rank, P, "prefill", "prompt")  # the same prompt everywhere
    cache = ShardedCache(group)
    layout = layout or _settings.layout
    S = input_ids.shape[1]
    split = S - S % (2 * P if layout == "zigzag" else P)  # the rest (< 2P tokens) goes in as one decode step
    with torch.no_grad(), settings(layout=layout, group=group):  # the layers read the layout prefill shards with
        if split:
            batch = shard_batch(input_ids[:, :split], layout=layout, group=group)
            batch["use_cache"] = True
            cache.prefilling = True
            cache.prefill_positions = local_positions(split, P, rank, layout)
            try:  # no logits needed: only the last local token's (not S/P x vocab of them)
                model(**batch, cache=cache, logits_to_keep=1)
            finally:
                cache.prefilling = False
        if split < S:
            pos = torch.arange(split, S, device=input_ids.device).expand(input_ids.shape[0], -1)
            model(input_ids=input_ids[:, split:], position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        layer.skip = 1  # model.generate feeds the prompt's last token again: that step stores nothing
    cache.spans.append((0, S, _crc(input_ids)))
    return cache


def _same_everywhere(input_ids: torch.Tensor, group, rank: int, P: int, who: str, what: str) -> None:
    """The same tokens on every rank, or a ValueError on every rank."""
    if P == 1:
        return
    mine = torch.tensor(
        [float(zlib.crc32(input_ids.cpu().numpy().tobytes())), *input_ids.shape],
        dtype=torch.float64,
        device=collective_device(group),  # NCCL takes no CPU tensor
    )
    every = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(every, mine, group=group)
    bad = [r for r, e in enumerate(every) if not torch.equal(e, every[0])]
    if bad:
        raise ValueError(
            f"tokenring.hf.{who} (rank {rank}): rank(s) {bad} pass a different {what} than rank 0 (shape or "
            f"tokens); every rank must pass the same full {what}"
        )


def extend(model, cache: ShardedCache, input_ids: torch.Tensor, strategy: str | None = None) -> ShardedCache:
    """Prefill the tokens of ``input_ids`` (B, L) -- the whole conversation so far, the same on every rank --
    that ``cache`` does not hold yet, sharded over the ranks: each rank runs the model on its share of the
    ``T`` new tokens only (:func:`tokenring.extend.split_new`, which keeps the shards balanced) and stores their
    K/V; attention runs through :func:`tokenring.extend.extend_attention` (``strategy``: one of
    ``tokenring.extend.STRATEGIES``, default ``"auto"``; ``"replicated"``: every rank runs the model on all
    ``T`` tokens, as a decode step, which is what ``auto`` does with at most :data:`REPLICATE_PER_RANK` new
    tokens per rank, and every strategy with fewer than ``P``). Returns ``cache``, ready for
    ``model.generate(input_ids, cache=cache)`` as after :func:`prefill`; a loop of ``extend`` and ``generate``
    over the turns of a chat gives the tokens of one process. An empty :class:`ShardedCache` works too
    (chunked prefill)."""
    group = cache.group
    rank, P = cache.rank, cache.P
    mixers.refuse_generation(model, P, "tokenring.hf.extend")
    if input_ids.dim() != 2:
        raise ValueError(
            f"tokenring.hf.extend: input_ids has shape {tuple(input_ids.shape)}; expected the full (batch, "
            f"seq) conversation so far, the same on every rank"
        )
    _same_everywhere(input_ids, group, rank, P, "extend", "conversation")
    held = cache.layers[0].total if cache.layers else 0
    if cache.layers and cache.layers[0].is_initialized and cache.layers[0].keys.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"tokenring.hf.extend: the cache holds a batch of {cache.layers[0].keys.shape[0]}, input_ids has "
            f"{input_ids.shape[0]} rows"
        )
    for a, b, crc in cache.spans:  # the tokens this cache was filled with must still be there
        if b > input_ids.shape[1] or _crc(input_ids[:, a:b]) != crc:
            raise ValueError(
                f"tokenring.hf.extend: tokens {a}..{b - 1} of input_ids differ from the ones this cache was "
                f"filled with (prefill / an earlier extend); pass the same conversation with the new turn "
                f"appended (a chat template that renders earlier turns differently needs a new prefill)"
            )
    counts = list(cache.layers[0].counts) if cache.layers else [0] * P
    T = input_ids.shape[1] - held
    if T <= 0:
        raise ValueError(
            f"tokenring.hf.extend: the cache already holds {held} tokens and input_ids has "
            f"{input_ids.shape[1]}: pass the whole conversation so far, ending with the new tokens"
        )
    if strategy not in (None, "auto", "replicated"):
        from .extend import STRATEGIES

        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}, 'auto' or 'replicated'"
            )
    for layer in cache.layers:
        layer.skip = 0  # the new tokens start right after the cached ones
    B = input_ids.shape[0]
    with torch.no_grad():
        few = T <= REPLICATE_PER_RANK * P and strategy in (None, "auto")
        if T < P or few or strategy == "replicated":  # too few to share: every rank runs them, as a decode step
            pos = torch.arange(held, held + T, device=input_ids.device).expand(B, -1)
            model(input_ids=input_ids[:, held:], position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        else:
            from .extend import split_new

            ranges = split_new(counts, T)
            a, b = ranges[rank]
            pos = torch.arange(held + a, held + b, device=input_ids.device).expand(B, -1)
            cache.extending, cache.strategy, cache._chosen = ranges, strategy or "auto", None
            try:
                model(
                    input_ids=input_ids[:, held + a : held + b],
                    position_ids=pos,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            finally:
                cache.extending = None
    for layer in cache.layers:
        layer.skip = 1  # model.generate feeds the last token again: that step stores nothing
    cache.spans.append((held, input_ids.shape[1], _crc(input_ids[:, held:])))
    return cache


def _crc(ids: torch.Tensor) -> int:
    return zlib.crc32(ids.contiguous().cpu().numpy().tobytes())
