"""Hugging Face ``transformers`` integration: ``import tokenring.hf`` registers ``attn_implementation="tokenring"``,
which runs a model's attention over a sequence sharded across ranks. Usage, and what is supported and refused:
docs/hf.md.
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
