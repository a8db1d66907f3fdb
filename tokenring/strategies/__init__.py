"""Strategy registry: a spec string -> :class:`~tokenring.strategies.base.Strategy`.

Specs: a family name (``token_ring``, ``ring``, ``ulysses``, ``ring_bidir``), optionally with a mode and
parameters: ``token_ring:relay`` (alias ``token_ring_paper``, the paper's schedule), ``token_ring:direct,c=4,k=3``,
``ring:direct,c=2,k=3``, ``ring:auto``. ``token_ring`` alone (like ``ring:auto``) names a *family choice*: the
cost model picks the variant (see :func:`tokenring.api.attention`). Hierarchical families run over nodes of
``n`` ranks: ``usp:n=8``, ``double_ring:n=8`` (``double_ring:direct,c=1,k=7,n=8``), ``token_ring_2d:n=8`` (a
family choice; ``token_ring_2d:relay,n=8``, ``token_ring_2d:direct,c=2,k=1,n=8``); without ``n=`` the node
size comes from ``inner_size=`` / ``$LOCAL_WORLD_SIZE``. ``keep`` (``double_ring:n=8,keep``,
``token_ring_2d:keep``): a two-level strategy keeps the K/V that crossed nodes in forward for its backward
(memory for inter-node bytes; ``auto`` never adds it). ``o=2`` (``double_ring:n=8,o=2``): each visiting round
runs as 2 sub-rounds over the K/V block's row halves, so compute starts on the first rows to cross. A new
strategy is one new module with a ``STRATEGY`` object, listed in ``_MODULES``; everything else (the public
API, ``auto``, the simulator, the benchmark, the demo, the tests) reads this registry.
"""
from __future__ import annotations

from functools import lru_cache

from .. import settings

from . import double_ring, ring, ring_bidir, token_ring, token_ring_2d, ulysses, usp
from .base import Strategy

__all__ = ["STRATEGIES", "FAMILIES", "HIERARCHICAL", "Strategy", "get", "why_not", "runnable", "code", "from_code",
           "CODE_LEN", "node_size", "with_node_size"]

_MODULES = (token_ring, ring, ulysses, ring_bidir, double_ring, token_ring_2d, usp)
STRATEGIES: dict[str, Strategy] = {m.STRATEGY.family or m.STRATEGY.name: m.STRATEGY for m in _MODULES}
FAMILIES = tuple(STRATEGIES)
ALIASES = {"token_ring_paper": "token_ring:relay"}
_MODES = ("", "auto", "relay", "direct")
_PARAMS = {"c": "chunks", "k": "lookahead", "n": "inner", "o": "outer"}
HIERARCHICAL = tuple(name for name, st in STRATEGIES.items() if st.hierarchical)


@lru_cache(maxsize=1024)
def get(spec: str) -> Strategy:
    """The strategy named by ``spec``; ``ValueError`` saying what is accepted otherwise."""
    spec = ALIASES.get(spec, spec)
    family, _, params = spec.partition(":")
    if family not in STRATEGIES:
        raise ValueError(f"strategy={spec!r} is unknown; choose one of {FAMILIES + tuple(ALIASES) + ('auto',)} "
                         f"(variants: 'token_ring:relay', 'token_ring:direct,c=2,k=1', 'ring:direct,c=1,k=3', "
                         f"'double_ring:n=8')")
    if not params:
        return STRATEGIES[family]
    items = params.split(",")
    mode = "" if "=" in items[0] or items[0] == "keep" else items.pop(0)
    if mode not in _MODES:
        raise ValueError(f"strategy={spec!r}: unknown mode {mode!r}; modes are relay, direct and auto")
    args = {}
    for item in items:
        if item == "keep":
            args["keep"] = True
            continue
        key, _, value = item.partition("=")
        if key not in _PARAMS or not value.isdigit():
            raise ValueError(f"strategy={spec!r}: parameters are c=<chunks>, k=<lookahead blocks> and, for the "
                             f"hierarchical strategies, n=<ranks per node>, keep and o=<outer chunks>; e.g. "
                             f"'{family}:direct,c=2,k=1'")
        args[_PARAMS[key]] = int(value)
    st = STRATEGIES[family].make(mode, **args)
    return st if st.name == spec else get(st.name)  # one object per canonical spec (schedules cache on it)


CODE_LEN = 7


def code(st: Strategy) -> list[float]:
    """``st`` as seven numbers (family, mode, chunks, lookahead, ranks per node, keep, outer chunks), to travel
    with the cross-rank signature."""
    return [float(FAMILIES.index(st.family or st.name)), float(_MODES.index(st.mode)), float(st.chunks),
            float(st.lookahead), float(st.inner), float(st.keep), float(st.outer)]


def from_code(values) -> Strategy:
    fam, mode, c, k, n, keep, outer = (int(x) for x in values)
    return get(STRATEGIES[FAMILIES[fam]].make(_MODES[mode], c, k, n, bool(keep), outer).name)


def node_size(inner_size: int | None = None) -> int:
    """Ranks per node for the hierarchical strategies: ``inner_size``, else the ``node_size`` setting
    (:mod:`tokenring.settings`: ``configure``, else ``$LOCAL_WORLD_SIZE``, which torchrun sets), else 0."""
    if inner_size is not None:
        if int(inner_size) < 1:
            raise ValueError(f"inner_size must be a positive number of ranks per node, got {inner_size}")
        return int(inner_size)
    return settings.get("node_size")


def with_node_size(st: Strategy, n: int) -> Strategy:
    """``st`` with ``n`` ranks per node, if it is a hierarchical family without a node size yet."""
    return st.with_inner(n) if st.hierarchical and not st.inner and n else st


def why_not(name: str, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
    """Why strategy ``name`` cannot run ``H`` query / ``Hkv`` K/V heads on ``P`` ranks (``None``: it can); a
    hierarchical family without a node size takes ``$LOCAL_WORLD_SIZE``, as ``tokenring.attention`` does."""
    return with_node_size(get(name), node_size()).check(H, Hkv, P, s, zigzag)


def runnable(H: int, Hkv: int, P: int, names=None) -> list[str]:
    """The strategies among ``names`` (default: the families) that can run these heads on ``P`` ranks."""
    return [n for n in (names or STRATEGIES) if why_not(n, H, Hkv, P) is None]
