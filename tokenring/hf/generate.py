"""Generation over a sequence-sharded KV cache: :func:`prefill` runs the prompt sharded into a
:class:`~tokenring.hf.cache.ShardedCache`; :func:`extend` adds a turn's tokens to it.
"""

from __future__ import annotations

import functools

import torch

from .. import mixers
from ..agreement import checksum, ranks_differing
from ..layouts import DOCUMENT_LAYOUTS, group_info, local_positions, resolve_layout, shard
from ..strategies.extend import STRATEGIES, split_new
from .batch import shard_batch
from .cache import ShardedCache
from .config import _settings, settings

__all__ = ["prefill", "extend", "REPLICATE_PER_RANK"]


# extend under "auto" runs at most this many new tokens per rank replicated (bench/results/extend.md)
REPLICATE_PER_RANK = 4


def prefill(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, group=None, layout: str | None = None
) -> ShardedCache:
    """Run the prompt ``input_ids`` (B, S), the same on every rank, sharded over the ranks and return the
    :class:`ShardedCache` of this rank's K/V rows, ready for ``model.generate(input_ids, cache=cache)``.
    ``attention_mask`` (B, S): prompts of different lengths padded on the left (pass it to ``generate`` too)."""
    group = group if group is not None else _settings.group
    rank, P = group_info(group)
    hybrid = mixers.refuse_generation(model, P, "tokenring.hf.prefill")
    if input_ids.dim() != 2:
        raise ValueError(
            f"tokenring.hf.prefill: input_ids has shape {tuple(input_ids.shape)}; expected the full "
            f"(batch, seq) prompt, the same on every rank"
        )
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"tokenring.hf.prefill: attention_mask is a {type(attention_mask).__name__}; pass the tokenizer's "
            f"(batch, seq) tensor of ones and (left) zeros"
        )
    _same_everywhere(input_ids, group, rank, P, "prefill", "prompt", attention_mask)  # the same prompt everywhere
    layout = resolve_layout(layout or _settings.layout, None, P, None)  # "auto": prompts are not packed: zigzag
    pads = _left_pads(input_ids, attention_mask, layout)
    cache = ShardedCache(group, model.config if hybrid else None)
    cache.pads = pads
    # a hybrid's mixers cannot take the last token twice, as attention can (model.generate feeds it again): their
    # states stop before it, and so does everything prefill stores
    S = input_ids.shape[1] - (1 if hybrid else 0)
    mask = None if pads is None else attention_mask.to(torch.bool)
    pos = (mask.cumsum(1) - 1).clamp_min(0) if mask is not None else torch.arange(S).expand(input_ids.shape[0], -1)
    pos = pos.to(input_ids.device)  # what model.generate computes from the mask: pads at 0, real tokens 0, 1, ...
    split = S - S % (2 * P if layout == "zigzag" else P)  # the rest (< 2P tokens) goes in as one decode step
    with torch.no_grad(), settings(layout=layout, group=group):  # the layers read the layout prefill shards with
        if split:
            if mask is None:
                # (no targets, so nothing to scale: allowed while a SequenceParallel is active, as under GRPO)
                batch = shard_batch(input_ids[:, :split], layout=layout, group=group, _scaled=True)
            else:
                batch = _padded_shard(input_ids[:, :split], pos[:, :split], mask[:, :split], layout, group)
            batch["use_cache"] = True
            cache.prefilling = True
            cache.prefill_positions = local_positions(split, P, rank, layout)
            try:  # no logits needed: only the last local token's (not S/P x vocab of them)
                model(**batch, cache=cache, logits_to_keep=1)
            finally:
                cache.prefilling = False
        if split < S:
            model(
                input_ids=input_ids[:, split:S],
                position_ids=pos[:, split:S],
                attention_mask=mask if mask is None else mask[:, :S],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    for layer in cache.attention_layers():
        layer.skip = 0 if hybrid else 1  # model.generate feeds the prompt's last token again: stored once
    cache.spans.append((0, input_ids.shape[1], checksum(input_ids)))
    return cache


def _left_pads(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layout: str) -> tuple[int, ...] | None:
    """Each row's left pads (``None``: no padding), or a ValueError (the same on every rank: the prompt and mask
    agree everywhere) for a mask a sharded cache cannot follow."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"tokenring.hf.prefill: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
            f"{tuple(input_ids.shape)}; pass the tokenizer's mask of the same prompt"
        )
    m = attention_mask.to(torch.bool).cpu()
    pads = (m.cumsum(1) == 0).sum(1)
    holes = m != (torch.arange(m.shape[1])[None] >= pads[:, None])
    if bool(holes.any()):
        b, i = (int(x) for x in holes.nonzero()[0])
        raise ValueError(
            f"tokenring.hf.prefill: row {b} of attention_mask masks token {i} after a real token (right padding "
            f"or a hole); generation over a sharded cache takes prompts padded on the left only: pad with "
            f"tokenizer.padding_side='left'"
        )
    if not bool(pads.any()):
        return None  # all ones: an unpadded prompt
    if layout in DOCUMENT_LAYOUTS:
        raise ValueError(
            f"tokenring.hf.prefill: layout={layout!r} places tokens by document and cannot give pads documents of "
            f"their own; prefill left-padded prompts with layout='zigzag' or 'contiguous'"
        )
    return tuple(pads.tolist())


def _padded_shard(input_ids, pos, mask, layout: str, group) -> dict:
    """This rank's shard of a left-padded prompt: ids, the positions ``generate`` gives real tokens, the mask
    (each row's pads become a document of their own in the layers) and the one document ``cu_seq_lens_q``, so
    that the positions, which restart at each row's first real token, are read as rotary positions only."""
    cut = functools.partial(shard, dim=1, layout=layout, group=group)
    whole = torch.tensor([0, input_ids.shape[1]], dtype=torch.int32)
    return dict(
        input_ids=cut(input_ids),
        position_ids=cut(pos),
        attention_mask=cut(mask.to(torch.int64)),
        cu_seq_lens_q=whole,
        cu_seq_lens_k=whole,
    )


def _same_everywhere(input_ids: torch.Tensor, group, rank: int, P: int, who: str, what: str, mask=None) -> None:
    """The same tokens (and attention mask) on every rank, or a ValueError on every rank."""
    if P == 1:
        return
    values = [checksum(input_ids), *input_ids.shape, checksum(mask) if mask is not None else -1.0]
    bad = ranks_differing(values, group, rank, P, f"tokenring.hf.{who}", f"the {what}")
    if bad:
        raise ValueError(
            f"tokenring.hf.{who} (rank {rank}): the ranks pass different {what}s: rank(s) {bad} differ from the "
            f"rest (shape, tokens or attention_mask; every rank named where none is the most common); every rank must "
            f"pass the same full {what}"
        )


def extend(model, cache: ShardedCache, input_ids: torch.Tensor, strategy: str | None = None) -> ShardedCache:
    """Prefill the tokens of ``input_ids`` (the whole conversation so far) that ``cache`` does not hold yet,
    sharded over the ranks; returns ``cache``, ready for ``model.generate`` (docs/hf.md)."""
    held, T = _check_turn(model, cache, input_ids, strategy)
    snap = cache.snapshot()
    try:
        _run_turn(model, cache, input_ids, held, T, strategy)
    except BaseException:  # a refused or failed turn leaves the cache as it was: the caller can retry
        cache.restore(snap)
        raise
    hybrid = bool(mixers.find_mixers(model))
    for layer in cache.attention_layers():
        layer.skip = 0 if hybrid else 1  # model.generate feeds the last token again: stored once (see prefill)
    cache.spans.append((held, input_ids.shape[1], checksum(input_ids[:, held:])))
    return cache


def _check_turn(model, cache: ShardedCache, input_ids: torch.Tensor, strategy) -> tuple[int, int]:
    """The tokens the cache holds and the new ones; a ValueError on every rank for a turn it cannot take."""
    group = cache.group
    rank, P = cache.rank, cache.P
    mixers.refuse_generation(model, P, "tokenring.hf.extend")
    if input_ids.dim() != 2:
        raise ValueError(
            f"tokenring.hf.extend: input_ids has shape {tuple(input_ids.shape)}; expected the full (batch, "
            f"seq) conversation so far, the same on every rank"
        )
    _same_everywhere(input_ids, group, rank, P, "extend", "conversation")
    if cache.pads is not None:
        raise ValueError(
            "tokenring.hf.extend: this cache was prefilled from left-padded prompts (attention_mask), which extend "
            "does not follow; prefill each conversation so far again: tokenring.hf.prefill(model, input_ids, "
            "attention_mask=...)"
        )
    first = cache.first_attention()
    held = first.total if first is not None else 0
    if first is not None and first.is_initialized and first.keys.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"tokenring.hf.extend: the cache holds a batch of {first.keys.shape[0]}, input_ids has "
            f"{input_ids.shape[0]} rows"
        )
    for a, b, crc in cache.spans:  # the tokens this cache was filled with must still be there
        if b > input_ids.shape[1] or checksum(input_ids[:, a:b]) != crc:
            raise ValueError(
                f"tokenring.hf.extend: tokens {a}..{b - 1} of input_ids differ from the ones this cache was "
                f"filled with (prefill / an earlier extend); pass the same conversation with the new turn "
                f"appended (a chat template that renders earlier turns differently needs a new prefill)"
            )
    T = input_ids.shape[1] - held
    if T <= 0:
        raise ValueError(
            f"tokenring.hf.extend: the cache already holds {held} tokens and input_ids has "
            f"{input_ids.shape[1]}: pass the whole conversation so far, ending with the new tokens"
        )
    if strategy not in (None, "auto", "replicated") and strategy not in STRATEGIES:
        raise ValueError(
            f"unknown extend strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}, 'auto' or 'replicated'"
        )
    return held, T


def _run_turn(model, cache: ShardedCache, input_ids: torch.Tensor, held: int, T: int, strategy) -> None:
    """The model over the ``T`` new tokens: sharded over the ranks, or replicated when they are few."""
    rank, P = cache.rank, cache.P
    first = cache.first_attention()
    counts = list(first.counts) if first is not None else [0] * P
    for layer in cache.attention_layers():
        layer.skip = 0  # the new tokens start right after the cached ones
    B = input_ids.shape[0]
    if mixers.find_mixers(model):
        # a hybrid's mixers hold one state per layer, the same on every rank: every rank runs the turn (and, as in
        # prefill, stops before its last token, which generate feeds)
        if strategy not in (None, "auto", "replicated"):
            raise ValueError(
                f"tokenring.hf.extend: strategy={strategy!r} shards the new tokens, which a model with sequence "
                f"mixers ({type(model).__name__}) cannot take from a cache yet; use strategy='replicated' or 'auto'"
            )
        if T > 1:
            with torch.no_grad():
                pos = torch.arange(held, held + T - 1, device=input_ids.device).expand(B, -1)
                model(input_ids=input_ids[:, held:-1], position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        return
    with torch.no_grad():
        few = T <= REPLICATE_PER_RANK * P and strategy in (None, "auto")
        if T < P or few or strategy == "replicated":  # too few to share: every rank runs them, as a decode step
            pos = torch.arange(held, held + T, device=input_ids.device).expand(B, -1)
            model(input_ids=input_ids[:, held:], position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        else:
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
