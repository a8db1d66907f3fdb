"""Generation with Hugging Face models over a sequence-sharded KV cache (no rank ever holds the whole cache):
:class:`ShardedCache`, filled by :func:`tokenring.hf.prefill`, used by ``model.generate`` (docs/hf.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from ..agreement import checksum, odd_ones
from ..comm import wait_collective
from ..decode import decode_attention, place_new
from ..device import collective_device
from ..extend import extend_attention
from ..layouts import group_info
from ..strategies.extend import Shards
from .masks import _mask_problem

__all__ = ["ShardedCache", "ShardedLayer", "ShardedHybridLayer", "take_step", "forget_steps", "step_attention"]

# layer index -> (the layer, what its last update did), read by the same layer's attention right after
_steps: dict[int, tuple["ShardedLayer", dict]] = {}


class ShardedLayer(DynamicLayer):
    """One layer's K/V rows held by this rank, (B, Hkv, n, d) as transformers stores them (``counts[r]``: rows
    rank ``r`` holds; ``skip``: 1 until the first decode step)."""

    def __init__(self, owner: "ShardedCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.counts = [0] * owner.P
        self.total = 0
        self.skip = 0
        self.positions = torch.zeros(0, dtype=torch.int64)  # global position of each row this rank holds

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]  # (B, Hkv, 0, d): no rows yet
        o = self.owner
        t = key_states.shape[-2]
        if key_states.shape[1::2] != self.keys.shape[1::2]:  # (every rank checks, even one holding no rows)
            raise ValueError(
                f"tokenring ShardedCache (layer {self.layer_idx}): this cache holds K/V with "
                f"{self.keys.shape[1]} heads of dim {self.keys.shape[3]}, the model gives "
                f"{key_states.shape[1]} of dim {key_states.shape[3]}: a cache from another model"
            )
        if not o.prefilling and self.total and key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"tokenring ShardedCache: this step's batch is {key_states.shape[0]} rows, the cache holds "
                f"{self.keys.shape[0]}: beam search and num_return_sequences > 1 widen the batch after prefill, "
                f"which a sharded cache does not follow. Generate one sequence per prompt (greedy or sampling), "
                f"or prefill the widened batch (input_ids.repeat_interleave(n, dim=0))"
            )
        self._before = self._state()  # what undo() puts back if the step's attention is refused
        if o.prefilling:
            if self.total:
                raise ValueError(
                    "tokenring ShardedCache: prefill into a cache that already holds tokens; use a new cache per prompt"
                )
            self.keys, self.values = key_states, value_states
            self.counts, self.total = [t] * o.P, t * o.P
            self.positions = o.prefill_positions
            info = {"prefill": True}
        elif o.extending is not None:  # tokenring.hf.extend: this rank's share of the step's new tokens
            ranges = o.extending
            a, b = ranges[o.rank]
            if t != b - a:
                raise ValueError(
                    f"tokenring ShardedCache (layer {self.layer_idx}): extend gave this rank new tokens {a}..{b - 1} "
                    f"but the model stores {t}"
                )
            start = self._store(key_states, value_states, a, b, ranges, ranges[-1][1] if ranges else 0)
            info = {"extend": (a, b), "shards": Shards(tuple(self.counts), tuple(ranges)), "start": start}
        elif self.skip:
            if self is o.first_attention():
                o.agree_step(key_states, self.total)
            if t != 1:
                raise ValueError(
                    f"tokenring ShardedCache: the first step after prefill must feed the prompt's last "
                    f"token again (as model.generate does), got {t} tokens"
                )
            self.skip = 0
            info = {"new": None, "start": self.total - 1}  # the query is the cached last token
        else:
            if self is o.first_attention():
                o.agree_step(key_states, self.total)
            placed = place_new(self.counts, t)
            a, b = placed[o.rank]
            start = self._store(key_states[:, :, a:b], value_states[:, :, a:b], a, b, placed, t)
            info = {"new": (a, b) if b > a else None, "start": start}
        _steps[self.layer_idx] = (self, info)
        return self.keys, self.values

    def _state(self) -> tuple:
        return self.keys, self.values, self.positions, list(self.counts), self.total, self.skip

    def undo(self) -> None:
        """Put back what the last :meth:`update` changed (its step's attention was refused)."""
        before = vars(self).pop("_before", None)
        if before is not None:
            self.keys, self.values, self.positions, self.counts, self.total, self.skip = before

    def commit(self) -> None:
        """The last :meth:`update`'s step stands: drop what :meth:`undo` would have put back."""
        vars(self).pop("_before", None)

    def _store(self, keys, values, a: int, b: int, ranges, step: int) -> int:
        """Append this rank's new tokens ``a..b-1`` of a step; returns the step's first global position."""
        start = self.total
        if b > a:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
            self.positions = torch.cat([self.positions, torch.arange(start + a, start + b)])
        for r, (x, y) in enumerate(ranges):
            self.counts[r] += y - x
        self.total += step
        return start

    def get_seq_length(self) -> int:
        return self.total - self.skip

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("tokenring ShardedCache: beam search is not supported (greedy and sampling are)")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("tokenring ShardedCache: cropping (assisted decoding) is not supported")

    def nbytes(self) -> int:
        """Bytes of the K/V this rank holds for the layer."""
        return 0 if self.keys is None else self.keys.numel() * self.keys.element_size() * 2


class ShardedHybridLayer(LinearAttentionLayer, ShardedLayer):
    """A layer with both a sequence mixer's states (the same on every rank) and this rank's K/V rows (Falcon-H1's
    layers run Mamba2 beside attention)."""

    def __init__(self, owner: "ShardedCache", layer_idx: int, number_of_states: int = 1):
        ShardedLayer.__init__(self, owner, layer_idx)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # the attention's update: (keys, values)
            ShardedLayer.lazy_initialization(self, *args)
        else:  # the mixer's states, by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return ShardedLayer.get_seq_length(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        ShardedLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        ShardedLayer.crop(self, tokens_to_remove)


class ShardedCache(Cache):
    """A transformers ``Cache`` whose layers hold this rank's rows of the K/V, and, for a model with sequence
    mixers (``config`` with linear layer types), each mixer's recurrent and convolution states, the same on every
    rank; fill it with :func:`prefill`."""

    def __init__(self, group=None, config=None):
        self.group = group
        self.rank, self.P = group_info(group)
        self.prefilling = False
        self.prefill_positions: torch.Tensor | None = None  # set by tokenring.hf.prefill: this rank's positions
        self.spans: list[tuple[int, int, int]] = []  # (start, end, crc32) of the token ids prefill / extend stored
        self.extending: list[tuple[int, int]] | None = None  # set by tokenring.hf.extend: every rank's new tokens
        self.strategy = "auto"  # the extend schedule (tokenring.extend.STRATEGIES or "auto")
        self._chosen: str | None = None  # what auto chose at the first layer of the current extend step
        self.log: list | None = None  # set to a list to receive each decode attention's {"bytes": received}
        self.pads: tuple[int, ...] | None = None  # set by prefill: each row's left pads (its attention_mask)
        self._mask_seen: tuple = (None, 0, None)  # (mask, length, verdict) of the step's first layer
        self.agreed = False  # this decode step's agreement ran (decode_attention's own check is then redundant)
        layers = self._hybrid_layers(config) if config is not None else None
        if layers is None:
            super().__init__(layer_class_to_replicate=self._new_layer)
        else:
            super().__init__(layers=layers)

    def _hybrid_layers(self, config) -> list | None:
        """One cache layer per model layer, as transformers' ``DynamicCache(config=...)`` lays them out, with
        :class:`ShardedLayer` for attention; ``None`` for a model without linear layers (layers made lazily)."""
        types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        kinds = [DYNAMIC_LAYER_TYPE_MAPPING.get(t, DynamicLayer) for t in types]
        if not any(issubclass(k, LinearAttentionCacheLayerMixin) for k in kinds):
            return None
        self.layers: list = []
        for kind, kw in zip(kinds, kwargs):
            states = kw.get("number_of_states", 1)
            if issubclass(kind, LinearAttentionCacheLayerMixin) and issubclass(kind, CacheLayerMixin):
                self.layers.append(ShardedHybridLayer(self, len(self.layers), states))
            elif issubclass(kind, LinearAttentionCacheLayerMixin):
                self.layers.append(LinearAttentionLayer(number_of_states=states))
            elif issubclass(kind, DynamicLayer):
                self.layers.append(ShardedLayer(self, len(self.layers)))
            else:  # a layer without attention or mixer state (transformers' DummyLayer)
                self.layers.append(kind(**kw))
        return self.layers

    def attention_layers(self) -> list[ShardedLayer]:
        return [layer for layer in self.layers if isinstance(layer, ShardedLayer)]

    def first_attention(self) -> ShardedLayer | None:
        return next((layer for layer in self.layers if isinstance(layer, ShardedLayer)), None)

    def set_conv_state(self, layer_idx: int, state_idx: int, state: torch.Tensor, length: int) -> None:
        """After a sharded prefill of ``length`` tokens: a mixer layer's convolution state ``(B, C, kernel)`` (its
        last inputs, the same on every rank), as transformers' ``update_conv_state`` leaves it after a prompt."""
        layer = self.layers[layer_idx]
        if not layer.is_conv_states_initialized[state_idx]:
            layer.lazy_initialization(conv_states=state, state_idx=state_idx, conv_kernel_size=state.shape[-1])
        layer.conv_states[state_idx].copy_(state)
        layer.has_previous_state[state_idx] = True
        if state_idx == 0:
            layer.cumulative_length_linear.add_(length)

    def mask_problem(self, mask, length: int) -> str | None:
        """What a decode step's attention mask says that this cache cannot follow (``None``: nothing): it must
        pad the rows as the prompt given to :func:`tokenring.hf.prefill` was (``length``: its columns, the cache's
        positions), or be all ones (or ``None``) for an unpadded prompt. Once per step: the layers share it."""
        seen, n, verdict = self._mask_seen
        if mask is seen and n == length:
            return verdict
        verdict = self._mask_verdict(mask, length)
        self._mask_seen = (mask, length, verdict)
        return verdict

    def _mask_verdict(self, mask, length: int) -> str | None:
        tensor2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        if self.pads is None:
            if tensor2d and not bool(mask.to(torch.bool).all()):
                return (
                    "the attention mask pads the rows but the prompt was prefilled without one: pass the same "
                    "attention_mask to tokenring.hf.prefill(model, input_ids, attention_mask=...) and to "
                    "model.generate (left padding)"
                )
            return _mask_problem(mask)
        B = len(self.pads)
        if not tensor2d or tuple(mask.shape) != (B, length):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else "none" if mask is None else type(mask)
            return (
                f"the prompt was prefilled with a padding mask (left pads per row {list(self.pads)}), but this "
                f"step's attention mask is {got} (transformers drops an all-ones one), not a ({B}, {length}) one: "
                f"pass model.generate the attention_mask given to tokenring.hf.prefill"
            )
        want = torch.arange(length)[None] >= torch.tensor(self.pads)[:, None]
        if not torch.equal(mask.to(torch.bool).cpu(), want):
            return (
                f"the attention mask does not pad the rows as the prompt given to tokenring.hf.prefill was (left "
                f"pads per row {list(self.pads)}, every later token attended): pass model.generate the same "
                f"attention_mask as prefill; a sharded cache masks only a prompt's left padding"
            )
        return None

    def row_documents(self, length: int) -> list[tuple[int, ...]] | None:
        """Each row's documents for :func:`tokenring.decode.decode_attention`: its left pads apart from the
        tokens after them (``None``: no row is padded)."""
        if self.pads is None:
            return None
        return [(0, p, length + 1) if p else () for p in self.pads]

    def agree_step(self, keys: torch.Tensor, total: int) -> None:
        """Before a decode step's sampling: the ranks compare the tokens they feed this step (a checksum of
        layer 0's new keys, a function of the tokens, their positions and the keys' shape and dtype) and their
        caches' lengths (``total`` tokens, layers), and raise the same ValueError on every rank if they differ,
        so no rank generates on from other tokens than the rest; and every rank takes rank 0's random state, so
        the tokens they sample next agree. One all_gather per step, which also stands for the step's
        ``decode_attention`` check."""
        device = keys.device
        self.agreed = False
        if self.P == 1 or device.type not in ("cpu", "cuda"):
            return
        cuda = device.type == "cuda"
        state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
        marks = [checksum(keys), float(total), float(len(self.layers))]
        mark = torch.tensor(marks, dtype=torch.float64).view(torch.uint8)
        row = torch.cat([state, mark]).to(collective_device(self.group))
        rows = [torch.empty_like(row) for _ in range(self.P)]
        wait_collective(
            dist.all_gather(rows, row, group=self.group, async_op=True),
            self.group,
            f"tokenring generate (rank {self.rank}): comparing this step's tokens",
            "a rank died or is not generating this step",
        )
        rows = [r.cpu() for r in rows]
        n = 8 * len(marks)
        held = [tuple(r[-n:].clone().view(torch.float64).tolist()) for r in rows]
        apart = odd_ones([h[1:] for h in held])
        if apart:
            raise ValueError(
                f"tokenring generate (rank {self.rank}): the ranks' sharded caches are not in step: rank(s) {apart} "
                f"differ from the rest (tokens, layers: {[h[1:] for h in held]}). Every rank must prefill the same "
                f"prompt (tokenring.hf.prefill) and run the same generate steps on its cache"
            )
        differ = odd_ones([h[0] for h in held])
        if differ:
            raise ValueError(
                f"tokenring generate (rank {self.rank}): the ranks feed different tokens at this step: rank(s) "
                f"{differ} differ from the rest (every rank named where none is the most common). Every rank must "
                f"generate the same sequence: the same generation options and logits processors everywhere"
            )
        if self.rank:
            torch.cuda.set_rng_state(rows[0][:-n], device) if cuda else torch.set_rng_state(rows[0][:-n])
        self.agreed = True

    def snapshot(self) -> tuple:
        """What :meth:`restore` puts back after a failed step: every layer's rows, positions, counts, total and
        skip, the spans and the extend schedule (tensors are replaced, never written in place, so references
        suffice)."""
        layers = [(layer, {k: _copy(v) for k, v in vars(layer).items()}) for layer in self.layers]
        # and the extend schedule: a refused extend(strategy=...) must not leave its strategy on the cache
        return layers, len(self.layers), list(self.spans), (self.strategy, self._chosen)

    def restore(self, snap: tuple) -> None:
        layers, n, spans, (self.strategy, self._chosen) = snap
        for layer, state in layers:
            vars(layer).clear()
            vars(layer).update(state)
        del self.layers[n:]
        self.spans[:] = spans

    def _new_layer(self) -> ShardedLayer:
        return ShardedLayer(self, len(self.layers))

    def nbytes(self) -> int:
        """Bytes of K/V this rank holds, all layers."""
        return sum(layer.nbytes() for layer in self.attention_layers())


def _copy(v):
    """A layer attribute as :meth:`ShardedCache.snapshot` keeps it: lists copied, and a mixer layer's states
    (dicts of tensors that transformers writes in place) cloned; K/V tensors are replaced, never written, so
    references suffice."""
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return {k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in v.items()}
    if isinstance(v, torch.Tensor) and v.dim() == 0:  # the linear layers' token count, added to in place
        return v.clone()
    return v


def take_step(module, key: torch.Tensor) -> tuple[ShardedLayer, dict] | None:
    """What the :class:`ShardedLayer` of ``module``'s layer did on its last update (``None``: nothing)."""
    step = _steps.pop(getattr(module, "layer_idx", None), None)
    return step if step is not None and step[0].keys.shape[-2] == key.shape[-2] else None


def forget_steps() -> None:
    """Drop every layer's pending step (at the start of a model's forward)."""
    _steps.clear()


def step_attention(
    layer: ShardedLayer,
    info: dict,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The attention of a step's queries (B, H, t, d) over the shards, a decode or an extend step as ``info``
    says; returns (B, t, H, d)."""
    owner = layer.owner
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    extending = "extend" in info
    mine = q.shape[1] if extending else (info["new"][1] - info["new"][0] if info["new"] else 0)
    docs = owner.row_documents(layer.total)
    cached = layer.positions[: k.shape[1] - mine] if window is not None or docs else None  # rows before this step
    if not extending:
        return decode_attention(
            q,
            k,
            v,
            new=info["new"],
            softmax_scale=scaling,
            group=owner.group,
            state=(layer.total, len(owner.layers)),
            check=layer.layer_idx == 0 and not owner.agreed,
            log=owner.log,
            sinks=sinks,
            window=window,
            positions=cached,
            start=info["start"],
            row_documents=docs,
        )
    first = layer.layer_idx == 0 or owner._chosen is None
    rec: list = []
    out = extend_attention(
        q,
        k,
        v,
        new=info["extend"],
        strategy=owner.strategy if first else owner._chosen,
        softmax_scale=scaling,
        group=owner.group,
        shards=info["shards"],
        state=(layer.total,) if first else None,
        log=rec,
        sinks=sinks,
        window=window,
        positions=cached,
    )
    if first and rec:
        owner._chosen = rec[-1]["strategy"]
    if owner.log is not None:
        owner.log.extend(rec)
    return out
