"""Layers that mix tokens along the sequence outside attention: found by what they are, refused when sharded.

TokenRing shards the sequence and makes each *attention* call exact. A layer that mixes tokens without going
through attention (linear attention and the gated delta rule, Mamba/SSM scans, short causal convolutions, token
shift, RWKV mixing) would run on each rank's shard as if it were the whole sequence: a silently wrong result.
Until such a layer has an exact sharded form, a model holding one is refused at P > 1.

A layer is recognised by its module (a ``torch.nn.Conv1d`` with a kernel longer than 1, the ``A_log`` /
``dt_bias`` parameters of a state-space or gated-delta recurrence, a class name naming a recurrent mixer) or by
the config's per-layer types (``layer_types``, ``layers_block_type``, ...) naming a non-attention mixer, never
by a list of model names. Only the modules that share the language model's config are looked at: a vision or
audio tower runs on its own inputs, not on the sharded sequence.
"""

from __future__ import annotations

import re
import sys
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["Mixer", "find_mixers", "refusal", "check_model", "check_from_stack"]

# a module class that names a sequence mixer other than softmax attention (the weakest of the signals)
_MIXER_CLASS = re.compile(
    r"mamba|deltanet|delta_?attention|gated_?delta|lightning|rwkv|retention|hgrn|short_?conv|time_?mix|"
    r"token_?shift|recurrent|xlstm|mlstm|slstm|hyena",
    re.IGNORECASE,
)
# a config's per-layer type that is not softmax attention ("linear_attention", "conv", "mamba", ...)
_MIXER_TYPE = re.compile(r"linear|conv|mamba|ssm|recurren|rwkv|delta|lightning|retention|hyena", re.IGNORECASE)
_CONFIG_LAYER_FIELDS = ("layer_types", "layers_block_type", "block_types", "layer_block_types")
_STATE_PARAMS = ("A_log", "dt_bias")


@dataclass
class Mixer:
    """One kind of sequence-mixing layer in a model: its module type, what it is, and where."""

    kind: str  # "short causal convolution", "state-space / gated-delta recurrence", ...
    type_name: str  # the module class (or the config's layer type)
    where: list[str] = field(default_factory=list)  # module paths (or "layer i")

    def __str__(self) -> str:
        at = ", ".join(self.where[:4]) + (f" and {len(self.where) - 4} more" if len(self.where) > 4 else "")
        return f"{self.type_name} ({self.kind}; {at})"


def _strong(module: torch.nn.Module) -> str | None:
    """What ``module`` itself is, from its type and parameters (not its name)."""
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return "short causal convolution"
    own = dict(module.named_parameters(recurse=False))
    if any(name in own for name in _STATE_PARAMS):
        return "state-space / gated-delta recurrence"
    return None


def _is_config(x) -> bool:
    return hasattr(x, "to_dict") and hasattr(x, "model_type")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if get is not None else config
    except TypeError:
        return get()


def find_mixers(model: torch.nn.Module, config=None) -> list[Mixer]:
    """The sequence mixers of ``model`` other than attention, grouped by module type (empty: none found).
    ``config``: the language model's config (default: the model's text config); modules governed by another
    config (a vision or audio tower) are skipped."""
    root_cfg = getattr(model, "config", None)
    text = config if config is not None else (_text_config(root_cfg) if _is_config(root_cfg) else None)
    found: dict[str, Mixer] = {}
    # the model's own prefix ("RecurrentGemma", "FalconMamba") says nothing about a module's kind
    family = re.sub(r"(For\w+|Model|PreTrainedModel)$", "", type(model).__name__)

    def record(kind: str, name: str, path: str) -> None:
        mixer = found.setdefault(name, Mixer(kind, name))
        if path not in mixer.where:
            mixer.where.append(path)

    def walk(module: torch.nn.Module, path: str, cfg, parent: tuple[str, str]) -> None:
        own = getattr(module, "config", None)
        if _is_config(own):
            cfg = own
        if cfg is not None and text is not None and cfg is not text and cfg is not root_cfg:
            return  # another tower (vision, audio): it does not see the sharded sequence
        kind = _strong(module)
        if kind is not None:  # a bare torch Conv1d is named by the layer that owns it
            name, where = parent if isinstance(module, torch.nn.Conv1d) else (type(module).__name__, path)
            record(kind, name, where or "(root)")
            return
        if _MIXER_CLASS.search(type(module).__name__.removeprefix(family)) and not any(
            _strong(m) for m in module.modules()
        ):
            record("linear attention / recurrent mixer", type(module).__name__, path or "(root)")
            return
        for child_name, child in module.named_children():
            walk(child, f"{path}.{child_name}" if path else child_name, cfg, (type(module).__name__, path))

    walk(model, "", None, (type(model).__name__, ""))
    for cfg in {id(c): c for c in (text, root_cfg) if _is_config(c)}.values():
        for attr in _CONFIG_LAYER_FIELDS:
            types = getattr(cfg, attr, None)
            if not isinstance(types, (list, tuple)):
                continue
            for i, t in enumerate(types):
                if isinstance(t, str) and _MIXER_TYPE.search(t):
                    key = f"{attr}={t!r}"
                    if not any(m.where for m in found.values()):  # modules found say more than the config
                        found.setdefault(key, Mixer("a non-attention layer type in the config", key)).where.append(
                            f"layer {i}"
                        )
    return list(found.values())


def refusal(model: torch.nn.Module, mixers: list[Mixer], P: int) -> str:
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    listed = "; ".join(str(m) for m in mixers)
    return (
        f"{name}{f' (model_type {model_type!r})' if model_type else ''} has layers that mix tokens along the "
        f"sequence outside attention: {listed}. tokenring shards the sequence over {P} ranks and makes only the "
        f"attention layers exact; these layers would run on each rank's shard as if it were the whole sequence "
        f"and give wrong results. Run this model on one rank per sequence (P = 1), or use a model whose "
        f"sequence mixing is all attention"
    )


_verdicts: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()


def check_model(model: torch.nn.Module, P: int, who: str = "tokenring") -> None:
    """Raise a ValueError naming the layers if ``model`` mixes tokens outside attention and ``P > 1``. Every
    rank holds the same model, so every rank raises the same error without a message."""
    if P <= 1:
        return
    model = getattr(model, "module", model)  # DDP and the like
    if model not in _verdicts:
        mixers = find_mixers(model)
        _verdicts[model] = refusal(model, mixers, P) if mixers else None
    if _verdicts[model] is not None:
        raise ValueError(f"{who}: {_verdicts[model]}")


_by_layer: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module | None]" = weakref.WeakKeyDictionary()


def _outer_model(frame, config) -> torch.nn.Module | None:
    """The outermost module on the call stack that holds ``config`` (the model whose forward is running)."""
    found = None
    while frame is not None:
        me = frame.f_locals.get("self")
        if isinstance(me, torch.nn.Module):
            cfg = getattr(me, "config", None)
            if (
                cfg is config
                or (config is None and _is_config(cfg))
                or (_is_config(cfg) and _text_config(cfg) is config)
            ):
                found = me
        frame = frame.f_back
    return found


def check_from_stack(layer: torch.nn.Module | None, P: int, who: str = "tokenring") -> None:
    """:func:`check_model` for the model whose forward called ``layer`` (found once per layer on the stack;
    ``layer=None``: the outermost model on the stack, for calls that have no module at hand)."""
    if P <= 1:
        return
    model = _by_layer.get(layer) if layer is not None else None
    if model is None:
        config = getattr(layer, "config", None) if layer is not None else None
        model = _outer_model(sys._getframe(1), config)
        if model is None:
            return  # called outside a model's forward: nothing to check
        if layer is not None:
            _by_layer[layer] = model
    check_model(model, P, who)
