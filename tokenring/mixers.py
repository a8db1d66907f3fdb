"""Layers that mix tokens along the sequence outside attention: found by what they are, made exact when sharded
by state passing (:class:`StatePassing`, the kinds :mod:`tokenring.recurrence` covers) or, when asked for by
name, by running them on the whole sequence (:class:`Replicated`) (docs/internals.md, "Layers beside attention").
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import mixer_op, recurrence
from .layouts import AUTO_LAYOUT, DOCUMENT_LAYOUTS, group_info, local_positions
from .ops import placed_layout

__all__ = [
    "Mixer",
    "Replicated",
    "StatePassing",
    "MIXER_MODES",
    "find_mixers",
    "prepare",
    "check_prepared",
    "refuse_generation",
    "model_on_stack",
]

MIXER_MODES = ("state_passing", "replicate")  # how prepare() makes a model's mixers exact

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
    """The sequence mixers of ``model`` other than attention, grouped by module type (``config``: the language
    model's; other towers are skipped)."""
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


def _describe(model: torch.nn.Module, mixers: list[Mixer]) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    listed = "; ".join(str(m) for m in mixers)
    return f"{type(model).__name__}{f' (model_type {model_type!r})' if model_type else ''} has layers that mix tokens along the sequence outside attention: {listed}"  # noqa: E501


class _Gather(torch.autograd.Function):
    """This rank's rows (B, s, ...) -> the whole sequence (B, S, ...) in natural order, on every rank."""

    @staticmethod
    def forward(ctx, x, group, order, mine):
        parts = [torch.empty_like(x) for _ in range(len(order) // x.shape[1])]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.mine = group, mine
        return torch.cat(parts, dim=1).index_select(1, order.to(x.device))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(1, ctx.mine.to(grad.device)), None, None, None


@dataclass
class _Sharding:
    group: object
    P: int
    order: torch.Tensor  # gathered rows (rank order) -> natural order
    mine: torch.Tensor  # this rank's rows in the natural order
    B: int
    s: int


class Replicated:
    """Hooks that run each sequence mixer of a model on the whole sequence, on every rank (inputs gathered,
    outputs cut back; ``context()``: the sharded forward's ``(group, layout)``, or ``None``)."""

    def __init__(self, model: torch.nn.Module, mixers: list[Mixer], context):
        self.context, self.mixers, self.description = context, mixers, _describe(model, mixers)
        modules = dict(model.named_modules())
        paths = sorted({p for m in mixers for p in m.where if p in modules})
        outer = [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]
        self.handles = []
        for path in outer:
            mod = modules[path]
            self.handles.append(mod.register_forward_pre_hook(self._before, with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._after, with_kwargs=True))
        self.wrapped = len(outer)
        self._stack: list[_Sharding | None] = []
        self._plans: dict = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _sharding(self, hidden: torch.Tensor) -> _Sharding | None:
        ctx = self.context()
        if ctx is None or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return None
        group, layout = ctx
        rank, P = group_info(group)
        if P == 1:
            return None
        B, s = hidden.shape[:2]
        key = (s, P, rank, layout)
        if key not in self._plans:
            if layout in (*DOCUMENT_LAYOUTS, AUTO_LAYOUT):
                raise ValueError(
                    f"{self.description}; these layers run on the whole sequence, which "
                    f"layout={layout!r} does not say how to assemble: use layout='zigzag' or 'contiguous'"
                )
            held = torch.cat([local_positions(s * P, P, r, layout) for r in range(P)])
            self._plans[key] = (torch.argsort(held), local_positions(s * P, P, rank, layout))
        order, mine = self._plans[key]
        return _Sharding(group, P, order, mine, B, s)

    def _before(self, module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        sh = self._sharding(hidden)
        self._stack.append(sh)
        if sh is None:
            return None

        def full(t):
            if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (sh.B, sh.s)):
                return t
            return _Gather.apply(t, sh.group, sh.order, sh.mine)  # integer masks and ids: no graph recorded

        return tuple(full(a) for a in args), {k: full(v) for k, v in kwargs.items()}

    def _after(self, module, args, kwargs, output):
        sh = self._stack.pop()
        if sh is None:
            return None
        S = sh.s * sh.P

        def cut(t):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (sh.B, S):
                return t.index_select(1, sh.mine.to(t.device))
            return t

        if isinstance(output, tuple):
            return type(output)(cut(t) for t in output) if type(output) is tuple else output
        return cut(output)


# transformers' module-level kernels a mixer's forward calls by name, and what each does when sharded:
# "conv", "delta", "ssd" run by state passing; "fused" (conv + scan + projections in one kernel) declines, so the
# layer takes its unfused path; "step" (one token over a cached state) has no place in a sharded forward
_KERNELS = {
    "causal_conv1d_forward": "conv",
    "torch_chunk_gated_delta_rule": "delta",
    "chunk_kimi_delta_attention": "delta",
    "mamba2_chunk_scan": "ssd",
    "mamba2_split_conv1d_scan_combined": "fused",
    "torch_recurrent_gated_delta_rule": "step",
    "recurrent_kimi_delta_attention": "step",
    "mamba2_selective_state_update": "step",
}
# names a mixer's forward calls -> the kinds of kernel it must reach when sharded
_CALLS = {
    "causal_conv1d_forward": "conv",
    "torch_chunk_gated_delta_rule": "delta",
    "chunk_kimi_delta_attention": "delta",
    "mamba2_scan_forward": "ssd",
}


# a module-level function whose name says it mixes tokens: a mixer's forward may call only those listed above
_MIXING_NAME = re.compile(r"scan|conv|delta|recurren|selective|state_update|lightning|ssm|mamba|retention|rwkv")


def _forward_names(cls) -> set[str]:
    fwd = inspect.unwrap(cls.forward)
    return set(getattr(getattr(fwd, "__code__", None), "co_names", ()))


@functools.lru_cache(maxsize=None)
def coverage(cls) -> frozenset[str] | None:
    """The kernel kinds a mixer class reaches through transformers' module-level kernels, if state passing
    covers all of its token mixing; ``None`` if it does not (a scan written inline, or a kernel not listed)."""
    names = _forward_names(cls)
    kinds = frozenset(_CALLS[n] for n in names if n in _CALLS)
    module = sys.modules.get(cls.__module__)
    if not kinds or module is None or not all(hasattr(module, n) for n in names & set(_CALLS)):
        return None
    mixing = {n for n in names if _MIXING_NAME.search(n) and callable(getattr(module, n, None))}
    if mixing - set(_CALLS) - set(_KERNELS):
        return None  # it calls a kernel state passing does not know
    if "ssd" in kinds and not hasattr(module, "mamba2_chunk_scan"):
        return None
    return kinds


@dataclass
class _Call:
    """The sharded forward of one mixer: where its rows sit, and the kernel kinds it reached."""

    where: str
    group: object
    rank: int
    P: int
    layout: str
    rows: int  # this rank's rows
    cu: torch.Tensor | None  # the documents' starts (cu_seq_lens_q), or None
    expected: frozenset
    reached: set = field(default_factory=set)

    @functools.cached_property
    def plan(self) -> recurrence.Plan:
        return mixer_op.plan(self.rows, self.P, self.rank, self.layout, self.cu)


_calls: list[_Call | None] = []  # the mixer forwards running now (innermost last); None: not sharded


def _dispatch(module: str, name: str, original):
    """``original`` (the kernel ``module.name`` of transformers) as it runs inside a sharded mixer's forward."""
    kind = _KERNELS[name]

    @functools.wraps(original)
    def kernel(*args, **kwargs):
        call = _calls[-1] if _calls else None
        if call is None:
            return original(*args, **kwargs)
        call.reached.add(kind)
        if kind == "fused":
            return None
        if kind == "step":
            raise ValueError(
                f"tokenring: {call.where} took its one-token path ({name}) in a sharded forward; a sharded "
                f"forward runs whole sequences (generation: tokenring.hf.prefill, then generate)"
            )
        if torch.compiler.is_compiling():  # one op in the graph (none if an argument cannot be a constant)
            out = mixer_op.compiled(kind, module, name, call, args, kwargs)
            if out is not None:
                return out
        return mixer_op.run(kind, original, call.plan, call.group, args, kwargs)

    kernel.__tokenring_original__ = original
    return kernel


def _install(cls) -> None:
    """Route the kernels ``cls``'s module calls by name through :func:`_dispatch` (once per module; outside a
    sharded mixer's forward they run as before)."""
    module = sys.modules[cls.__module__]
    for name in _KERNELS:
        fn = getattr(module, name, None)
        if fn is not None and not hasattr(fn, "__tokenring_original__"):
            setattr(module, name, _dispatch(module.__name__, name, fn))


class StatePassing:
    """Hooks that run each covered mixer of a model on this rank's rows only, its kernels exchanging states
    (:mod:`tokenring.recurrence`; ``context()``: the sharded forward's ``(group, layout)``, or ``None``)."""

    def __init__(self, model: torch.nn.Module, modules: dict[str, torch.nn.Module], context):
        self.context = context
        self.modules = modules  # path -> the mixer module hooked
        self.handles = []
        for path, mod in modules.items():
            _install(type(mod))
            kinds = coverage(type(mod))
            where = f"{type(mod).__name__} ({path})"
            pre = functools.partial(self._before, where=where, expected=kinds)
            self.handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._after, with_kwargs=True, always_call=True))
        self.wrapped = len(modules)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _before(self, module, args, kwargs, *, where, expected):
        hidden = args[0] if args else kwargs.get("hidden_states")
        ctx = self.context()
        call = None
        names = ("cache", "cache_params", "past_key_values")
        cache = next((kwargs[n] for n in names if kwargs.get(n) is not None), None)
        if ctx is not None and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
            group, layout = ctx
            rank, P = group_info(group)
            if P > 1 and cache is not None and not hasattr(cache, "set_conv_state"):
                raise ValueError(
                    f"tokenring: {where} was given a {type(cache).__name__} in a sharded forward, whose states "
                    f"would cover this rank's rows only: pass use_cache=False (tokenring.hf.shard_batch does), and "
                    f"generate with tokenring.hf.prefill"
                )
            cu = kwargs.get("cu_seq_lens_q")
            sharded = P > 1 and (cache is None or cache.prefilling)  # else a step every rank runs whole (decode)
            if P == 1 and cache is None and cu is not None:  # one rank: packed documents only
                sharded = torch.compiler.is_compiling() or len(cu) > 2
            if sharded:
                layout = placed_layout(layout, hidden.shape[1] * P, P, cu)  # ("auto": as shard_batch placed)
                if layout in DOCUMENT_LAYOUTS and cu is None:
                    raise ValueError(
                        f"tokenring: {where} runs under layout={layout!r}, which places tokens by document, but "
                        f"was not given the documents (cu_seq_lens_q, which tokenring.hf.shard_batch passes)"
                    )
                call = _Call(where, group, rank, P, layout, hidden.shape[1], cu, expected)
        _calls.append(call)

    def _after(self, module, args, kwargs, output):
        call = _calls.pop() if _calls else None
        if call is not None and output is not None and not call.expected <= call.reached:
            raise ValueError(
                f"tokenring: {call.where} did not reach its {sorted(call.expected - call.reached)} kernel in a "
                f"sharded forward (it took a path tokenring does not shard), so its rows could be wrong; run it "
                f"with tokenring.hf.prepare(model, mixers='replicate'), or on one rank per sequence"
            )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrappers."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module) or isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        model = getattr(model, "_orig_mod", None) or model.module
    return model


_prepared: "weakref.WeakKeyDictionary[torch.nn.Module, Replicated | str | None]" = weakref.WeakKeyDictionary()


def _uncovered(model: torch.nn.Module, mixers: list[Mixer]) -> tuple[dict, list[Mixer]]:
    """The outermost modules of ``mixers`` that state passing covers (path -> module), and the mixers it does
    not."""
    modules = dict(model.named_modules())
    covered = {p: modules[p] for m in mixers for p in m.where if p in modules and coverage(type(modules[p]))}

    def inside(p: str) -> bool:  # a part of a covered mixer (KDA's forget gate): the mixer's kernels run it
        return p in covered or any(p.startswith(q + ".") for q in covered)

    rest = [m for m in mixers if not all(p in modules and inside(p) for p in m.where)]
    outer = {p: mod for p, mod in covered.items() if not any(p.startswith(q + ".") for q in covered if q != p)}
    return outer, rest


def _state_passing(model: torch.nn.Module, mixers: list[Mixer], context) -> StatePassing | str:
    covered, rest = _uncovered(model, mixers)
    if rest:
        return (
            f"{_describe(model, rest)}. State passing does not cover these layers; running them whole on every "
            f"rank would cost each rank their work and activations over the whole sequence (P times its share). "
            f"Ask for that by name with tokenring.hf.prepare(model, mixers='replicate') before the first forward, "
            f"or run this model on one rank per sequence (P = 1)"
        )
    return StatePassing(model, covered, context)


def prepare(
    model: torch.nn.Module, context, P: int, who: str = "tokenring", mode: str | None = None
) -> StatePassing | Replicated | None:
    """Make ``model``'s sequence mixers exact when sharded over ``P > 1`` ranks: :class:`StatePassing` hooks
    where :mod:`tokenring.recurrence` covers every mixer kind (else a ValueError naming the rest), or with
    ``mode="replicate"`` :class:`Replicated` hooks; returns the hooks, or ``None`` for a model with no such
    layers. A model is prepared once (``mode=None``: as it was, else state passing); asking again for another
    mode is a ValueError."""
    if mode is not None and mode not in MIXER_MODES:
        raise ValueError(f"{who}: mixers={mode!r}; use one of {MIXER_MODES}")
    model = _unwrap(model)
    if P <= 1:  # one rank: only packed documents need the hooks (their states start again at each document)
        if model in _prepared or mode == "replicate":
            return _prepared.get(model)
        mixers = find_mixers(model)
        if not mixers or _uncovered(model, mixers)[1]:
            return None  # (no hooks: transformers' own kernels, as in one process)
    if model in _prepared:
        got = _prepared[model]
        have = "replicate" if isinstance(got, Replicated) else "state_passing" if got is not None else None
        if have is not None and mode is not None and have != mode:
            raise ValueError(
                f"{who}: this model's mixers were already prepared with mixers={have!r}; prepare a model once, "
                f"before its first sharded forward"
            )
    if model not in _prepared:
        mixers = find_mixers(model)
        if not mixers:
            _prepared[model] = None
        elif mode != "replicate":
            _prepared[model] = _state_passing(model, mixers, context)
        else:
            hooks = Replicated(model, mixers, context)
            if not hooks.wrapped:
                hooks.remove()
                _prepared[model] = (
                    f"{_describe(model, mixers)}. No module of these layers was found to run them on the whole "
                    f"sequence; without that they would see only this rank's shard. Run this model on one rank "
                    f"per sequence (P = 1)"
                )
            else:
                _prepared[model] = hooks
    got = _prepared[model]
    if isinstance(got, str):
        raise ValueError(f"{who}: {got}")
    return got


def check_prepared(model: torch.nn.Module, P: int, who: str = "tokenring") -> None:
    """At an attention layer: a ValueError on every rank unless the model's mixers were prepared first."""
    if P <= 1:
        return
    model = _unwrap(model)
    if model in _prepared:
        got = _prepared[model]
        if isinstance(got, str):
            raise ValueError(f"{who}: {got}")
        return
    mixers = find_mixers(model)
    if not mixers:
        _prepared[model] = None
        return
    raise ValueError(
        f"{who}: {_describe(model, mixers)}, and they were not prepared before this forward began (the model "
        f"built no attention mask through transformers' mask interface, or runs under torch.compile), so they "
        f"may have seen only this rank's shard. Call tokenring.hf.prepare(model) once before the first forward"
    )


def refuse_generation(model: torch.nn.Module, P: int, who: str) -> bool:
    """Before generation over a sequence-sharded cache: whether ``model`` has sequence mixers (they then run by
    state passing in prefill and whole on every rank per decoded token); a ValueError if they cannot (a kind state
    passing does not cover, or mixers prepared with ``"replicate"``)."""
    if P <= 1:
        return bool(find_mixers(_unwrap(model)))
    model = _unwrap(model)
    mixers = find_mixers(model)
    if not mixers:
        return False
    passing = isinstance(_prepared[model], StatePassing) if model in _prepared else not _uncovered(model, mixers)[1]
    if not passing:
        raise ValueError(
            f"{who}: {_describe(model, mixers)}. Generation over a sequence-sharded cache needs their recurrent "
            f"and convolution states after the prompt, which only state passing gives, and it does not cover "
            f"these layers (or they were prepared with mixers='replicate'): generate in one process (P = 1); "
            f"training and full-sequence forwards are exact when sharded with mixers='replicate'"
        )
    return True


_by_layer: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


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


def model_on_stack(layer: torch.nn.Module | None = None, config=None) -> torch.nn.Module | None:
    """The model whose forward is running (found on the call stack; once per ``layer``): the outermost module
    holding ``layer``'s config (or ``config``, or any config when neither is given)."""
    model = _by_layer.get(layer) if layer is not None else None
    if model is None:
        cfg = getattr(layer, "config", None) if layer is not None else config
        model = _outer_model(sys._getframe(1), cfg)
        if model is not None and layer is not None:
            _by_layer[layer] = model
    return model
