"""Strategy registry: a spec string -> :class:`~tokenring.strategies.base.Strategy`. The specs, and how to add a
strategy (one module with a ``STRATEGY`` object, listed in ``_MODULES``): docs/schedules.md, "Strategy specs".
"""

from __future__ import annotations

from functools import lru_cache

from .. import settings
from . import double_ring, ring, ring_bidir, token_ring, token_ring_2d, ulysses, usp
from .base import Strategy
from .spec import CODE_LEN, Spec

__all__ = [
    "STRATEGIES",
    "FAMILIES",
    "HIERARCHICAL",
    "NAMES",
    "Strategy",
    "Spec",
    "get",
    "why_not",
    "runnable",
    "code",
    "from_code",
    "CODE_LEN",
    "node_size",
    "with_node_size",
]

_MODULES = (token_ring, ring, ulysses, ring_bidir, double_ring, token_ring_2d, usp)
STRATEGIES: dict[str, Strategy] = {m.STRATEGY.family or m.STRATEGY.name: m.STRATEGY for m in _MODULES}
FAMILIES = tuple(STRATEGIES)
ALIASES = {"token_ring_paper": "token_ring:relay"}
NAMES = FAMILIES + tuple(ALIASES) + ("auto",)  # every name strategy= takes besides variants
HIERARCHICAL = tuple(name for name, st in STRATEGIES.items() if st.hierarchical)


@lru_cache(maxsize=1024)
def get(text: str) -> Strategy:
    """The strategy named by ``text`` (a :class:`Spec` in its text form); ``ValueError`` saying what is
    accepted otherwise."""
    text = ALIASES.get(text, text)
    family = str(text).partition(":")[0]
    if family not in STRATEGIES:
        raise ValueError(
            f"strategy={text!r} is unknown; choose one of {NAMES} (variants: 'token_ring:relay', "
            f"'token_ring:direct,c=2,k=1', 'ring:direct,c=1,k=3', 'double_ring:n=8')"
        )
    spec = Spec.parse(text)
    if not spec.given():
        return STRATEGIES[family]
    st = _make(spec)
    return st if st.name == text else get(st.name)  # one object per canonical spec (schedules cache on it)


def _make(spec: Spec) -> Strategy:
    """The family's member that ``spec`` names; ``ValueError`` naming the parameters it does not take."""
    family = STRATEGIES[spec.family]
    extra = [f for f in spec.given() if f not in family.PARAMS]
    if extra:
        shown = {"mode": "a mode", "chunks": "c=", "lookahead": "k=", "inner": "n=", "keep": "keep", "outer": "o="}
        takes = f"only {', '.join(shown[f] for f in family.PARAMS)}" if family.PARAMS else "no parameters"
        hint = (
            f"; node sizes (n=), keep and o= are for the hierarchical strategies ({', '.join(HIERARCHICAL)})"
            if {"inner", "keep", "outer"} & set(extra)
            else ""
        )
        raise ValueError(
            f"strategy {spec.family!r} takes {takes}; {spec.text()!r} sets {', '.join(shown[f] for f in extra)}{hint}"
        )
    return family.make(spec)


def code(st: Strategy) -> list[float]:
    """``st`` as numbers (:meth:`Spec.code`), to travel with the cross-rank signature."""
    return st.spec.code(FAMILIES)


def from_code(values) -> Strategy:
    spec = Spec.from_code(values, FAMILIES)
    return get(_make(spec).name)


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
    return get(st.with_inner(n).name) if st.hierarchical and not st.inner and n else st


def why_not(name: str, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
    """Why strategy ``name`` cannot run ``H`` query / ``Hkv`` K/V heads on ``P`` ranks (``None``: it can); a
    hierarchical family without a node size takes ``$LOCAL_WORLD_SIZE``, as ``tokenring.attention`` does."""
    return with_node_size(get(name), node_size()).check(H, Hkv, P, s, zigzag)


def runnable(H: int, Hkv: int, P: int, names=None) -> list[str]:
    """The strategies among ``names`` (default: the families) that can run these heads on ``P`` ranks."""
    return [n for n in (names or STRATEGIES) if why_not(n, H, Hkv, P) is None]
