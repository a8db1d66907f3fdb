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
  (``model.generate(input_ids, cache=tokenring.hf.prefill(model, input_ids))``, see :mod:`tokenring.hf.cache`);
- ``output_attentions=True`` (the weights are never materialised; ``None`` is returned with a warning).

Not detected: models that overlay their own mask functions on the causal mask (e.g. bidirectional image-token
blocks in some vision-language models) would silently get plain causal attention; do not use them here.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tokenring.hf needs transformers: pip install 'tokenring-attn[hf]'") from e

from .attention import attention_forward, mask_forward, prepare, register
from .batch import causal_lm_loss, gather_logits, reduce_loss, shard_batch, shift_labels, tiled_loss
from .cache import ShardedCache
from .config import IGNORE_INDEX, NAME, configure, settings
from .ddp import all_reduce_grads
from .generate import REPLICATE_PER_RANK, extend, prefill
from .training import SequenceParallel

__all__ = [
    "NAME",
    "IGNORE_INDEX",
    "REPLICATE_PER_RANK",
    "register",
    "configure",
    "settings",
    "attention_forward",
    "mask_forward",
    "shard_batch",
    "gather_logits",
    "reduce_loss",
    "all_reduce_grads",
    "shift_labels",
    "tiled_loss",
    "prefill",
    "extend",
    "prepare",
    "ShardedCache",
    "causal_lm_loss",
    "SequenceParallel",
    "SequenceParallelTrainer",  # noqa: F822 (module __getattr__, imports transformers.Trainer when asked)
]


def __getattr__(name: str):
    if name == "SequenceParallelTrainer":  # imports transformers.Trainer (and accelerate) only when asked for
        from .trainer import SequenceParallelTrainer

        return SequenceParallelTrainer
    raise AttributeError(name)
