"""Strategy registry: a spec string -> :class:`~tokenring.strategies.base.Strategy`.

Specs: a family name (``token_ring``, ``ring``, ``ulysses``, ``ring_bidir``), optionally with a mode and
parameters: ``token_ring:relay`` (alias ``token_ring_paper``, the paper's schedule), ``token_ring:direct,c=4,k=3``,
``ring:direct,c=2,k=3``, ``ring:auto``. ``token_ring`` alone (like ``ring:auto``) names a *family choice*: the
cost model picks the variant (see :func:`tokenring.api.attention`). A new strategy is one new module with a
``STRATEGY`` object, listed in ``_MODULES``; everything else (the public API, ``auto``, the simulator, the
benchmark, the demo, the tests) reads this registry.
"""
from __future__ import annotations

from functools import lru_cache

from . import ring, ring_bidir, token_ring, ulysses
from .base import RelayOrDirect, Strategy

__all__ = ["STRATEGIES", "FAMILIES", "Strategy", "get", "why_not", "runnable", "code", "from_code"]

_MODULES = (token_ring, ring, ulysses, ring_bidir)
STRATEGIES: dict[str, Strategy] = {m.STRATEGY.family or m.STRATEGY.name: m.STRATEGY for m in _MODULES}
FAMILIES = tuple(STRATEGIES)
ALIASES = {"token_ring_paper": "token_ring:relay"}
_MODES = ("", "auto", "relay", "direct")
# Families that take a mode and parameters, by the class of their registered object.
_CLASSES = {name: type(st) for name, st in STRATEGIES.items() if isinstance(st, RelayOrDirect)}


@lru_cache(maxsize=1024)
def get(spec: str) -> Strategy:
    """The strategy named by ``spec``; ``ValueError`` saying what is accepted otherwise."""
    spec = ALIASES.get(spec, spec)
    family, _, params = spec.partition(":")
    if family not in STRATEGIES:
        raise ValueError(f"strategy={spec!r} is unknown; choose one of {FAMILIES + tuple(ALIASES) + ('auto',)} "
                         f"(variants: 'token_ring:relay', 'token_ring:direct,c=2,k=1', 'ring:direct,c=1,k=3')")
    if not params:
        return STRATEGIES[family]
    if family not in _CLASSES:
        raise ValueError(f"strategy {family!r} takes no parameters (got {spec!r})")
    mode, *kv = params.split(",")
    args = {}
    for item in kv:
        key, _, value = item.partition("=")
        if key not in ("c", "k") or not value.isdigit():
            raise ValueError(f"strategy={spec!r}: parameters are c=<chunks> and k=<lookahead blocks>, e.g. "
                             f"'{family}:direct,c=2,k=1'")
        args["chunks" if key == "c" else "lookahead"] = int(value)
    st = _CLASSES[family](mode, **args)
    return st if st.name == spec else get(st.name)  # one object per canonical spec (schedules cache on it)


def code(st: Strategy) -> list[float]:
    """``st`` as four numbers (family, mode, chunks, lookahead), to travel with the cross-rank signature."""
    return [float(FAMILIES.index(st.family or st.name)), float(_MODES.index(st.mode)), float(st.chunks),
            float(st.lookahead)]


def from_code(values) -> Strategy:
    fam, mode, c, k = (int(x) for x in values)
    family = FAMILIES[fam]
    if not _MODES[mode]:
        return STRATEGIES[family]
    return get(_CLASSES[family](_MODES[mode], c, k).name)


def why_not(name: str, H: int, Hkv: int, P: int, s: int | None = None, zigzag: bool = False) -> str | None:
    """Why strategy ``name`` cannot run ``H`` query / ``Hkv`` K/V heads on ``P`` ranks (``None``: it can)."""
    return get(name).check(H, Hkv, P, s, zigzag)


def runnable(H: int, Hkv: int, P: int, names=None) -> list[str]:
    """The strategies among ``names`` (default: the families) that can run these heads on ``P`` ranks."""
    return [n for n in (names or STRATEGIES) if why_not(n, H, Hkv, P) is None]
