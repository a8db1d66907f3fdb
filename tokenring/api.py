"""Public entry point: ``tokenring.attention`` — validation and dispatch to a strategy."""

from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import settings
from .comm import collective_device, get_timeout, group_store, publish_refusal
from .device import device_type as device_kind
from .device import values_travel
from .instrument import NONE as NO_HOOKS
from .instrument import current as current_instruments
from .kernels import attention_inputs, fold_scale, softmax_scale_of
from .layouts import LAYOUTS, check_layout, default_layout, document_bounds, group_info
from .masks import check_bounds_tensor, make_mask, whole_numbers, window_pair
from .ops import IdentityCache, register_extras
from .schedules import Shapes
from .single import SINGLE
from .strategies import CODE_LEN, NAMES, from_code, node_size, with_node_size
from .strategies import code as strategy_code
from .strategies import get as get_strategy
from .strategies.base import Config

__all__ = ["attention", "choose_strategy", "resolve", "STRATEGY_NAMES", "forget_choices"]

STRATEGY_NAMES = NAMES


class _Verified:
    """``(id(group), signature)`` -> the strategy that runs: signatures already verified identical on every
    rank, with the choice rank 0 made for "auto" / a family choice (set_topology clears it on every rank: calls
    re-decide). At most ``size`` per group, the oldest dropped first: entries go in only after an exchange
    every rank of the group makes, so every rank keeps the same ones and skips (or repeats) an exchange alike,
    and packed training, with a new mask every step, does not grow it."""

    def __init__(self, size: int = 256):
        self.size, self.groups = size, {}

    def get(self, key):
        return self.groups.get(key[0], {}).get(key)

    def __contains__(self, key) -> bool:
        return key in self.groups.get(key[0], {})

    def __getitem__(self, key):
        return self.groups[key[0]][key]

    def __setitem__(self, key, value) -> None:
        group = self.groups.setdefault(key[0], {})
        group[key] = value
        while len(group) > self.size:
            group.pop(next(iter(group)))

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def clear(self) -> None:
        self.groups.clear()


_checked = _Verified()
_exchanges: dict = {}  # per group: signature exchanges so far (the same count on every rank in step)


def forget_choices() -> None:
    """Drop the verified signatures and the cached ``auto`` choices (``set_topology`` calls this)."""
    _checked.clear()


settings.on_change(lambda name: forget_choices() if name == "topology" else None)


def forget_groups() -> None:
    """Forget every group's verified signatures and exchange count (after its process group is destroyed)."""
    _checked.clear()
    _exchanges.clear()


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
    where = f"rank {rank}: "
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{where}{name} has shape {tuple(t.shape)}; expected 4 dims (batch, seq_local, heads, "
                f"head_dim), the flash-attn layout"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"{where}k {tuple(k.shape)} and v {tuple(v.shape)} must have the same batch, length and heads (v's "
            f"head dim may differ from q/k's, as in MLA)"
        )
    B, s, H, d = q.shape
    for what, i, name in (
        ("batch", 0, "batch size"),
        ("seq_local", 1, "local sequence length"),
        ("head_dim", 3, "head dim"),
    ):
        if k.shape[i] != q.shape[i]:
            raise ValueError(
                f"{where}q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in {name} (dim {i}, "
                f"{what}); q and k/v must be shards of the same tokens"
            )
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"{where}q has {H} heads and k/v {Hkv}: the query heads must be a multiple of the "
            f"key/value heads (MHA: equal, GQA: H % Hkv == 0, MQA: Hkv == 1)"
        )
    if 0 in q.shape:
        raise ValueError(
            f"{where}q has shape {tuple(q.shape)}: batch, local length, heads and head dim must be positive"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not q.is_floating_point():
        raise ValueError(f"{where}q has dtype {q.dtype}; attention needs floating point inputs")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{where}q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one device"
        )


def choose_strategy(
    H: int,
    Hkv: int,
    P: int,
    *,
    B: int = 1,
    s: int | None = None,
    d: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    causal: bool = False,
    layout: str | None = None,
    backward: bool = True,
    device_type: str = "cpu",
    topology=None,
    requested: str = "auto",
    mask=None,
    inner_size: int | None = None,
) -> str:
    """What ``strategy=requested`` (``"auto"``, or a family choice such as ``"token_ring"``) runs for this
    rank's shard shapes on ``P`` ranks: a concrete variant's spec.

    With the local length ``s`` given, the cost model (``tokenring.sim``) simulates every candidate's schedule
    on the group's topology (``tokenring.set_topology``, ``$TOKENRING_TOPOLOGY``, else ``loopback`` on CPU /
    ``h100-nvswitch-8`` on CUDA) and picks the fastest; ``tokenring.explain`` shows the numbers. Ulysses is
    a candidate only when ``H % P == 0``. Without ``s``, the shape-free rule: TokenRing for MHA, pass-KV
    ring for GQA/MQA (K+V is smaller than Q there). ``mask``: a :class:`tokenring.masks.Mask` (packed
    documents, window) the candidates' schedules are cut for. ``inner_size``: ranks per node (default
    ``$LOCAL_WORLD_SIZE``), for the hierarchical strategies."""
    n = node_size(inner_size)
    requested = requested if requested == "auto" else with_node_size(get_strategy(requested), n).name
    if s is None or P < 2:
        if requested != "auto":
            return get_strategy(requested).variants(P)[0].name
        return "token_ring:relay" if H == Hkv else "ring"
    from .sim.auto import choose

    layout = layout or default_layout(causal)
    return choose(
        Shapes(B, s, H, Hkv, d, dtype, P), causal, layout, backward, device_type, topology, requested, mask, n
    )[0]


def resolve(
    strategy: str,
    q_shape,
    k_shape,
    P: int,
    *,
    dtype=torch.bfloat16,
    causal: bool = False,
    layout: str | None = None,
    backward: bool = True,
    device_type: str = "cpu",
    mask=None,
    inner_size: int | None = None,
):
    """The concrete strategy ``tokenring.attention(strategy=...)`` runs for these shard shapes on ``P`` ranks
    (from this process's topology setting; inside ``attention`` rank 0 decides for everyone)."""
    if strategy != "auto":
        st = with_node_size(get_strategy(strategy), node_size(inner_size))
        if st.mode != "auto":
            return st
    B, s, H, d = q_shape
    return get_strategy(
        choose_strategy(
            H,
            k_shape[2],
            P,
            B=B,
            s=s,
            d=d,
            dtype=dtype,
            causal=causal,
            layout=layout,
            backward=backward,
            device_type=device_type,
            requested=strategy,
            mask=mask,
            inner_size=inner_size,
        )
    )


def _code(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes, unlike hash()


def _signature_of(
    q_shape,
    k_shape,
    dtype,
    device_type: str,
    causal,
    layout,
    strategy,
    scale,
    backward,
    mask_code: int,
    inner: int,
    sinks: bool,
) -> list[float]:
    B, s, H, d = q_shape
    return [
        0.0,
        B,
        s,
        H,
        k_shape[2],
        d,
        _code(str(dtype)),
        _code(device_type),
        float(causal),
        LAYOUTS.index(layout),
        _code(strategy),
        scale,
        float(backward),
        float(mask_code),
        float(inner),
        float(sinks),
    ]


def _signature(
    q, k, causal, layout, strategy, scale, backward, mask_code: int, inner: int, sinks: bool = False
) -> list[float]:
    return _signature_of(
        q.shape, k.shape, q.dtype, device_kind(q), causal, layout, strategy, scale, backward, mask_code, inner, sinks
    )


_FIELDS = [
    "refused",
    "batch",
    "local length",
    "query heads",
    "key/value heads",
    "head dim",
    "dtype",
    "device type",
    "causal",
    "layout",
    "strategy",
    "softmax_scale",
    "backward (inputs requiring grad)",
    "cu_seqlens / window (checksum)",
    "inner_size (ranks per node)",
    "sinks (given)",
]
# What a rank that refuses its own arguments sends: the flag, and nothing the others could compare.
_REFUSED = [1.0] + [0.0] * (len(_FIELDS) - 1)


def _show(field: str, value: float) -> str:
    if field == "strategy":
        return next((repr(n) for n in STRATEGY_NAMES if _code(n) == value), f"a spec with code {int(value)}")
    return f"{value:g}" if field in ("softmax_scale",) else str(int(value))


def _agree(
    sig: list[float],
    decide,
    describe: str,
    group,
    device,
    rank: int,
    P: int,
    remember: bool = True,
    calibrate_for=None,
):
    """Verify that every rank calls with the same shapes and options, and return the strategy to run.

    ``decide()`` resolves the strategy; only rank 0 calls it (``auto`` runs the cost model there) and its
    answer travels with the signature exchange, so no per-host input (cores, threads, a topology set on one
    rank only) can make the ranks disagree. Done once per (group, signature); later calls reuse the result.
    ``remember=False`` (a rank that will refuse its arguments): exchange every time, never skip. ``decide``
    ``None``: this rank refuses its arguments (``sig`` is ``_REFUSED``)."""
    key = (id(group), tuple(sig))  # nothing per-host in it: a rank that re-checked alone would wait for the others
    if remember and key in _checked:
        return _checked[key]
    lazy = rank == 0 and calibrate_for is not None and settings.get("calibrate") and id(group) not in _calibrated
    choice = strategy_code(decide()) if rank == 0 and decide is not None and not lazy else [-1.0] * CODE_LEN
    mine = torch.tensor(sig + choice + [float(lazy)], dtype=torch.float64, device=device)
    allsig = [torch.empty_like(mine) for _ in range(P)]
    # Each rank marks its arrival in the rendezvous store, so a rank that never comes can be named.
    n = _exchanges[id(group)] = _exchanges.get(id(group), -1) + 1
    store, prefix = group_store(group), f"tokenring/arrived/{n}/"
    try:
        store.set(prefix + str(rank), "1")
    except Exception:
        store = None
    try:  # the marks of two exchanges ago are read by nobody now: the store stays flat over packed steps
        if store is not None and n >= 2:
            store.delete_key(f"tokenring/arrived/{n - 2}/{rank}")
    except Exception:
        pass
    work = dist.all_gather(allsig, mine, group=group, async_op=True)
    if not values_travel(group):  # PyTorch's fake process group: nothing to compare, each rank decides
        work.wait()
        if decide is None:
            return None
        chosen = _checked[key] = get_strategy(decide().name)
        return chosen
    try:
        work.wait(datetime.timedelta(seconds=get_timeout()))
    except Exception as e:
        missing = ""
        try:
            gone = [r for r in range(P) if not store.check([prefix + str(r)])]
            missing = (
                f" Rank(s) {gone} never reached this call: they died or do not call attention here." if gone else ""
            )
        except Exception:
            pass
        raise RuntimeError(
            f"tokenring: rank {rank} could not compare call signatures with the other ranks within "
            f"{get_timeout():.0f} s ({e}).{missing} A rank has died, or is not calling tokenring.attention at this "
            f"point (every rank of the group must call it with the same shapes and options). The process group "
            f"cannot be used again after this: destroy it and start the ranks again."
        ) from e
    refused = [r for r, other in enumerate(allsig) if other[0].item()]
    if refused:  # a refusing rank raises its own error; the others say who refused, at the same moment
        raise ValueError(
            f"tokenring: rank(s) {refused} refused their arguments to attention (each raised an error "
            f"saying why); here: {describe}"
        )
    for r, other in enumerate(allsig):
        bad = [
            f"{f} ({_show(f, a)} on rank {r}, {_show(f, b)} on rank {rank})"
            for f, a, b in zip(_FIELDS, other.tolist(), sig)
            if a != b
        ]
        if bad:
            raise ValueError(
                f"tokenring: rank {r} calls attention with a different {'; '.join(bad)}; here: {describe}. "
                f"Every rank must pass shards of the same shape, dtype and options; shard the sequence with "
                f"tokenring.shard() so local lengths are equal."
            )
    if allsig[0][-1].item():  # rank 0 asks every rank to calibrate the group first
        _calibrate_group(group, *calibrate_for)
        return _agree(sig, decide, describe, group, device, rank, P, remember, calibrate_for)
    chosen = from_code(allsig[0][-CODE_LEN - 1 : -1].tolist())
    if remember:
        _checked[key] = chosen
    return chosen


_calibrated: set = set()  # ids of the groups calibrated in this process (the calibrate setting)


def _calibrate_group(group, q, k) -> None:
    """Calibrate ``group`` for calls shaped like ``q`` / ``k`` and make the profile this process's topology."""
    from .calibration import calibrate

    P = dist.get_world_size(group)
    profile = calibrate(
        group, seq=q.shape[1] * P, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3], dtype=q.dtype
    )
    settings.configure(topology=profile)  # clears the verified signatures and auto's choices on every rank
    _calibrated.add(id(group))


def _single_device(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def _check_sinks(sinks, q: torch.Tensor, rank: int) -> None:
    if sinks is None:
        return
    H = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or not sinks.is_floating_point():
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"rank {rank}: sinks must be a floating point tensor of shape ({H},) (one logit per query "
            f"head), got {shape}"
        )
    if sinks.device != q.device:
        raise ValueError(f"rank {rank}: sinks are on {sinks.device} and q on {q.device}; move them to one device")


def _refuse_everywhere(problem: ValueError, group, rank: int, P: int):
    """Tell the other ranks this rank refuses its arguments, then raise ``problem``. Ranks that compare
    signatures for this call raise at once; ranks that had agreed on their shapes at an earlier call go ahead
    without comparing, and name this rank and its reason when its messages do not come (the store report)."""
    publish_refusal(group, rank, str(problem))
    try:
        _agree(list(_REFUSED), None, "", group, collective_device(group), rank, P, remember=False)
    except ValueError:  # its own error is the one to raise
        pass
    except RuntimeError:
        raise ValueError(
            f"{problem} (The other ranks did not compare signatures with this one: they had agreed on their "
            f"shapes at an earlier call and went ahead, so they will fail waiting for this rank and name it. "
            f"The process group cannot be used again after this: destroy it and start the ranks again.)"
        ) from None
    raise problem from None


def _ranked(e: ValueError, rank: int) -> ValueError:
    return e if str(e).startswith(f"rank {rank}:") else ValueError(f"rank {rank}: {e}")


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    strategy: str = "auto",
    layout: str | None = None,
    cu_seqlens=None,
    window: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
    group=None,
    inner_size: int | None = None,
) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across the ranks of ``group``.

    ``q``: (B, s, H, d), ``k``: (B, s, Hkv, d), ``v``: (B, s, Hkv, dv), this rank's shard (laid out by
    ``layout``; default ``"zigzag"`` when causal, else ``"contiguous"``, and it must match how the caller
    sharded); ``dv`` may differ from ``d`` (MLA; zero columns fill the gap, so the shorter side's bytes grow).
    Returns (B, s, H, dv) in ``q.dtype``: the same rows of single-device attention over the whole sequence.
    Differentiable in ``q``, ``k``, ``v`` (and ``sinks``). ``strategy``: ``"token_ring"`` (the TokenRing
    variant the cost model predicts fastest), ``"token_ring_paper"`` (= ``"token_ring:relay"``), an explicit
    variant such as ``"token_ring:direct,c=2,k=3"`` or ``"ring:direct,c=1,k=3"``, ``"ring"``, ``"ring:auto"``,
    ``"ring_bidir"``, ``"ulysses"`` or ``"auto"`` (every strategy and variant). Choices are made on rank 0 and
    shared. With no process group initialised (or one rank) plain attention runs.

    Packed sequences and sliding windows (flash-attn's conventions, over the *global* sequence of
    ``S = s * P`` tokens, whatever the layout): ``cu_seqlens`` ``[0, end_1, ..., S]`` (1-D ints, the same on
    every rank) puts documents one after another, a query seeing keys of its own document only (for every
    row of the batch); ``window=(left, right)`` lets query ``i`` see keys ``i-left .. i+right`` (``-1``:
    unbounded; ``causal`` caps ``right`` at 0). Every strategy takes both; blocks no query sees are neither
    computed nor sent (Ulysses skips the computation only: its all-to-alls move every row).
    ``layout="zigzag_docs"`` (with ``cu_seqlens``, every document a multiple of ``2P`` tokens; shard with
    ``tokenring.shard(x, layout="zigzag_docs", cu_seqlens=cu)``) zigzags each document over the ranks, which
    balances causal work whatever the document lengths.

    ``sinks``: gpt-oss style attention sinks, a (H,) tensor of logits (one per query head, not scaled by
    ``softmax_scale``) added to every row's softmax denominator: the output of a row is
    ``sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``. The sink is one more partial in the merge; its
    gradient on each rank is that rank's rows' share (sum it over the ranks like any replicated weight's).

    Under ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``scaled_dot_product_attention``
    does. Under ``torch.compile`` the call is one custom op (``tokenring::attention_fwd``, no graph break);
    ``"auto"`` and family choices are then made when the graph is traced, from this rank's cost model unless an
    eager call with the same shapes already agreed on one (ranks that traced different choices are refused
    at run time).

    Beyond one node: ``"usp"`` (Ulysses inside a node, ring between nodes), ``"double_ring"`` and
    ``"token_ring_2d"`` (ring / TokenRing inside a node, K/V ring between nodes) run over nodes of
    ``inner_size`` ranks (default ``$LOCAL_WORLD_SIZE``, which torchrun sets): ranks ``a*n .. a*n+n-1`` of
    the group form node ``a``. With a node size known (or a multi-node topology set), ``"auto"`` considers
    them too.
    """
    q, k, v, softmax_scale, dv = attention_inputs(q, k, v, softmax_scale)
    if dv is not None:  # MLA: the value head dim differs from q/k's; run with zero columns, keep dv of them
        return attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, strategy=strategy, layout=layout,
            cu_seqlens=cu_seqlens, window=window, sinks=sinks, group=group, inner_size=inner_size,
        )[..., :dv]  # fmt: skip
    compiling = torch.compiler.is_compiling()
    rank, P = group_info(group)
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) or cu_seqlens is None else None
    try:
        _check_local(q, k, v, rank)
        _check_sinks(sinks, q, rank)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None)
        if cu is not None:
            check_bounds_tensor(cu)
        plan = _plan(
            tuple(q.shape),
            tuple(k.shape),
            q.dtype,
            device_kind(q),
            strategy,
            causal,
            softmax_scale,
            layout,
            None if cu_seqlens is None or cu is not None else _frozen(cu_seqlens),
            cu is not None,
            _frozen(window),
            sinks is not None,
            _group_name(group),
            inner_size,
            backward,
            compiling,
        )
    except ValueError as e:
        if P == 1 or compiling:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    strategy, scale, layout, window, n, cu_list, plain = plan
    if cu_list is not None:
        cu = torch.tensor(cu_list, dtype=torch.int64)
    if plain:  # one rank, nothing to mask: PyTorch's own attention
        q, scale = fold_scale(q, scale)
        return _single_device(q, k, v, causal, scale)
    hooks = current_instruments()
    if hooks is not None and compiling:
        raise ValueError("tokenring.attention: tokenring.instrument() (tracing, byte logs) works in eager mode only")
    extras_id, holder = register_extras(hooks)
    from .ops import attention_op

    out = attention_op(
        q, k, v, sinks, cu, strategy, causal, scale, layout, window, _group_name(group), n, backward, extras_id
    )
    del holder  # the op's autograd context keeps it while backward may still run
    return out


def _frozen(x):
    """Lists (cu_seqlens, window) as tuples, so that the plan is a function of constants."""
    if x is None or isinstance(x, (int, float)):
        return x
    try:
        return tuple(_frozen(y) for y in x)
    except TypeError:
        return x


@torch._dynamo.assume_constant_result
def _plan(
    q_shape,
    k_shape,
    dtype,
    device_type: str,
    strategy: str,
    causal: bool,
    softmax_scale,
    layout,
    cu_list,
    cu_tensor: bool,
    window,
    sinks: bool,
    group_name: str,
    inner_size,
    backward: bool,
    compiling: bool,
):
    """What can be decided from the call's constants (shapes, dtypes, options), before any value is read or a
    rank is asked: ``(strategy, scale, layout, window, node size, cu_seqlens list, plain)``. Under
    ``torch.compile`` it runs once per trace (a constant of the graph) and also picks the concrete strategy
    (:func:`trace_choice`). ``plain``: one rank and no mask or sinks (PyTorch's SDPA). ValueError for what
    this rank refuses."""
    from .ops import resolve_group

    group = resolve_group(group_name)
    rank, P = group_info(group)
    layout = layout if layout is not None else default_layout(causal)
    n = node_size(inner_size)
    if strategy != "auto":  # unknown names fail here, before any communication
        strategy = with_node_size(get_strategy(strategy), n).name
    check_layout(layout)
    B, s, H, d = q_shape
    Hkv = k_shape[2]
    scale = softmax_scale_of(softmax_scale, d)
    cu_list = whole_numbers(cu_list, "cu_seqlens") if cu_list is not None else None
    window = list(window_pair(window)) if window is not None else None
    if P > 1 and layout == "zigzag" and s % 2:
        raise ValueError(
            f"layout='zigzag' needs an even local length (two chunks per rank), got {s}; pad the "
            f"global sequence to a multiple of 2*P = {2 * P}"
        )
    if P > 1 and strategy != "auto":
        why = get_strategy(strategy).check(H, Hkv, P, s, causal and layout == "zigzag")
        if why:
            raise ValueError(why)
    if cu_list is not None or layout == "zigzag_docs" or window is not None:
        _mask_of(s, P, cu_list, window, causal, layout)  # malformed documents / windows fail here
    plain = (
        P == 1
        and cu_list is None
        and not cu_tensor
        and not sinks
        and layout != "zigzag_docs"
        and make_mask(s, None, window, causal) is None
    )
    if compiling and P > 1:
        strategy = trace_choice(
            q_shape,
            k_shape,
            dtype,
            device_type,
            strategy,
            causal,
            layout,
            window,
            cu_list is not None or cu_tensor,
            backward,
            group,
            n,
            scale,
            sinks,
        )
    return strategy, scale, layout, window, n, cu_list, plain


def _describe(q, k, causal, layout, strategy, mask, sinks) -> str:
    return (
        f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}, causal={causal}, layout={layout}, "
        f"strategy={strategy!r}"
        + (f", {mask.describe()}" if mask is not None else "")
        + (", with sinks" if sinks is not None else "")
    )


def _config_of(group, rank, P, causal, layout, scale, mask, sinks, hooks) -> Config:
    return Config(
        group=group,
        rank=rank,
        P=P,
        causal=causal,
        layout=layout,
        scale=scale,
        mask=mask,
        sinks=sinks,
        hooks=hooks or NO_HOOKS,
    )


_masks = IdentityCache()


def _mask_of(s: int, P: int, cu, window, causal: bool, layout: str):
    """The call's mask; reading ``cu_seqlens`` once per tensor (the layers of a model share it)."""
    key = (s, P, tuple(window) if window is not None else None, causal, layout)
    cached = isinstance(cu, torch.Tensor)
    hit = _masks.get([cu]) if cached else None
    if hit is not None and hit[0] == key:
        return hit[1]
    if layout == "zigzag_docs":
        document_bounds(s * P, P, cu)  # every document must split over the ranks
    mask = make_mask(s * P, cu, window, causal, force=layout == "zigzag_docs")
    if cached:
        _masks.put([cu], (key, mask))
    return mask


def run_forward(
    q,
    k,
    v,
    sinks,
    cu,
    strategy: str,
    causal: bool,
    scale: float,
    layout: str,
    window,
    group,
    inner: int,
    backward: bool,
    extras,
):
    """The forward of :func:`attention` on ``P > 1`` ranks once its local arguments are checked (the body of
    the ``tokenring::attention_fwd`` op): the mask, the cross-rank agreement, the strategy's schedule.
    Returns ``(out, strategy, extra)`` (``extra``: what backward needs besides the inputs and ``out``)."""
    rank, P = group_info(group)
    try:
        mask = _mask_of(q.shape[1], P, cu, window, causal, layout)
    except ValueError as e:
        if P == 1:
            raise _ranked(e, rank) from None
        _refuse_everywhere(_ranked(e, rank), group, rank, P)
    if P == 1:
        q, scale = fold_scale(q, scale)
        out, saved = SINGLE.forward(q, k, v, _config_of(group, rank, P, causal, layout, scale, mask, sinks, extras))
        return out, SINGLE, SINGLE.saved_extra(saved)
    n = inner

    def decide():  # a concrete variant; for "auto" / a family choice the cost model, run on rank 0 only
        return resolve(
            strategy,
            q.shape,
            k.shape,
            P,
            dtype=q.dtype,
            causal=causal,
            layout=layout,
            backward=backward,
            device_type=device_kind(q),
            mask=mask,
            inner_size=n or None,
        )

    sig = _signature(
        q, k, causal, layout, strategy, scale, backward, mask.key if mask is not None else 0, n, sinks is not None
    )
    auto = strategy == "auto" or get_strategy(strategy).mode == "auto"
    strat = _agree(
        sig,
        decide,
        _describe(q, k, causal, layout, strategy, mask, sinks),
        group,
        collective_device(group),
        rank,
        P,
        calibrate_for=(q, k) if auto else None,
    )
    q, scale = fold_scale(q, scale)
    cfg = _config_of(group, rank, P, causal, layout, scale, mask, sinks, extras)
    q, k, v = strat.prepare(q, k, v, P)
    out, saved = strat.forward(q, k, v, cfg)
    return out, strat, strat.saved_extra(saved)


def run_backward(
    dout, q, k, v, out, sinks, cu, strat, extra: list, causal: bool, scale: float, layout: str, window, group, extras
):
    """The backward of :func:`run_forward` (the body of ``tokenring::attention_bwd``): ``[dq, dk, dv]``, and
    ``dsinks`` (this rank's rows' share) with sinks."""
    rank, P = group_info(group)
    mask = _mask_of(q.shape[1], P, cu, window, causal, layout)
    q_in, (q, folded) = q, fold_scale(q, scale)
    cfg = _config_of(group, rank, P, causal, layout, folded, mask, sinks, extras)
    dq, dk, dv, dsinks = strat.backward(dout, strat.saved_full(extra, q, k, v, out), cfg)
    dk, dv = strat.unprepare(dk, dv, k.shape[2])
    if folded != scale:
        dq = dq * scale
    return [dq.to(q_in.dtype), dk, dv] + ([dsinks.to(sinks.dtype)] if sinks is not None else [])


def fake_extra(q, k, v, cu, strategy: str, causal: bool, layout: str, window, group, inner: int):
    """Empty tensors shaped like :func:`run_forward`'s ``extra`` for a concrete ``strategy`` (the op's fake)."""
    rank, P = group_info(group)
    st = get_strategy(strategy) if P > 1 else SINGLE
    if P > 1 and (strategy == "auto" or st.mode == "auto"):
        raise ValueError(f"tokenring: strategy {strategy!r} must be resolved before tracing (tokenring.ops)")
    mask = None
    if st.keep:
        if cu is not None or layout == "zigzag_docs":
            raise ValueError(
                f"tokenring: {strategy!r} keeps K/V pieces whose shapes depend on cu_seqlens' values; "
                f"under torch.compile use it without 'keep' or without documents"
            )
        mask = make_mask(q.shape[1] * P, None, window, causal)
    cfg = Config(group=group, rank=rank, P=P, causal=causal, layout=layout, scale=1.0, mask=mask)
    q, k, v = st.prepare(q, k, v, P)
    return st.extra_like(q, k, v, cfg)


def trace_choice(
    q_shape,
    k_shape,
    dtype,
    device_type: str,
    strategy: str,
    causal: bool,
    layout: str,
    window,
    documents: bool,
    backward: bool,
    group,
    inner: int,
    scale: float,
    sinks: bool,
) -> str:
    """The concrete strategy a traced (``torch.compile``) call runs: a named variant itself; for ``"auto"`` or a
    family choice, the one an eager call agreed on for these shapes (documents aside), else this rank's cost
    model (without the documents, whose bounds are values)."""
    st = get_strategy(strategy) if strategy != "auto" else None
    if st is not None and st.mode != "auto":
        return strategy
    rank, P = group_info(group)
    mask = None if documents else make_mask(q_shape[1] * P, None, window, causal)
    sig = _signature_of(
        q_shape,
        k_shape,
        dtype,
        device_type,
        causal,
        layout,
        strategy,
        scale,
        backward,
        mask.key if mask is not None else 0,
        inner,
        sinks,
    )
    hit = _checked.get((id(group), tuple(sig)))
    if hit is not None:
        return hit.name
    return resolve(
        strategy,
        tuple(q_shape),
        tuple(k_shape),
        P,
        dtype=dtype,
        causal=causal,
        layout=layout,
        backward=backward,
        device_type=device_type,
        mask=mask,
        inner_size=inner or None,
    ).name
