"""Every setting of tokenring, in one place, with one precedence rule: the call's argument, :func:`configure`,
the environment variable, the default. The table of settings: docs/internals.md, "Settings".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["configure", "options", "get", "SETTINGS"]


def _positive_seconds(x) -> float:
    v = float(x)
    if not v > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {x!r}")
    return v


def _flag(x) -> bool:
    if isinstance(x, bool):
        return x
    if str(x) in ("0", "1"):
        return str(x) == "1"
    raise ValueError(f"expected 0 or 1 (or a bool), got {x!r}")


def _cpu_backward(x) -> str | None:
    if x not in ("cpu_flash", "math"):
        raise ValueError(f"cpu_backward must be 'cpu_flash' or 'math', got {x!r}")
    return x


def _ranks(x) -> int:
    v = int(x)
    if v < 0:
        raise ValueError(f"node_size must be a number of ranks per node, got {x!r}")
    return v


def _layer(x) -> tuple[int, int, int]:
    parts = [int(v) for v in (x.split(",") if isinstance(x, str) else x)]
    if len(parts) != 3 or min(parts) < 1 or parts[0] % parts[1]:
        raise ValueError(f"layer must be (query heads, key/value heads dividing them, head dim), got {x!r}")
    return tuple(parts)


def _topology(x):
    for check in _checks.get("topology", ()):  # validate now, not at the first attention call
        check(x)
    return x


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    default: Any
    parse: Callable[[Any], Any]
    doc: str
    from_env: Callable[[str], Any] | None = None  # how the variable's text reads, if not as ``parse`` does


SETTINGS = {
    s.name: s
    for s in (
        Setting("timeout", "TOKENRING_TIMEOUT", 300.0, _positive_seconds, "longest wait for a peer on gloo, seconds"),
        Setting("topology", "TOKENRING_TOPOLOGY", None, _topology, "the interconnect auto models"),
        Setting(
            "layer",
            "TOKENRING_LAYER",
            None,
            _layer,
            "the attention layer (heads, key/value heads, head dim) layout='auto' places packed batches for",
        ),
        Setting(
            "compile_merge",
            "TOKENRING_COMPILE_MERGE",
            True,
            _flag,
            "compiled merge kernel on CUDA",
            lambda text: text != "0",
        ),
        Setting("cpu_backward", "TOKENRING_CPU_BACKWARD", None, _cpu_backward, "fused or math backward on CPU"),
        Setting(
            "calibrate",
            "TOKENRING_CALIBRATE",
            False,
            _flag,
            "calibrate a group's kernels and links at its first auto call",
        ),
        Setting(
            "check_calls",
            "TOKENRING_CHECK_CALLS",
            False,
            _flag,
            "compare every attention call's signature across ranks, not only a new one's (one small all_gather "
            "per call): a rank refusing its input then reaches the others as the ValueError, the group usable",
        ),
        Setting(
            "node_size",
            "LOCAL_WORLD_SIZE",
            0,
            _ranks,
            "ranks per node for the hierarchical strategies",
            lambda text: int(text) if text.isdigit() else 0,
        ),
    )
}
_configured: dict[str, Any] = {}
_checks: dict[str, list[Callable[[Any], Any]]] = {}  # from higher layers: tokenring.sim.topology checks names
_listeners: list[Callable[[str], None]] = []  # called with a setting's name when configure changes it


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise ValueError(f"tokenring has no setting {name!r}; the settings are {', '.join(SETTINGS)}") from None


def configure(**values) -> None:
    """Set settings for this process (``None``: back to the environment variable / default)."""
    parsed = {name: None if v is None else _setting(name).parse(v) for name, v in values.items()}
    for name, v in parsed.items():  # all valid: apply
        if v is None:
            _configured.pop(name, None)
        else:
            _configured[name] = v
        for fn in _listeners:
            fn(name)


def source(name: str) -> tuple[Any, str]:
    """A setting's value and where it came from (``"configure"``, ``"$VAR=..."``, ``"default"``)."""
    s = _setting(name)
    if name in _configured:
        return _configured[name], "tokenring.configure"
    env = os.environ.get(s.env, "")
    if env:
        try:
            return (s.from_env or s.parse)(env), f"${s.env}={env}"
        except ValueError as e:
            raise ValueError(f"${s.env}={env!r}: {e}") from None
    return s.default, "default"


def get(name: str) -> Any:
    return source(name)[0]


def options() -> dict[str, tuple[Any, str]]:
    """Every setting's value and where it came from."""
    return {name: source(name) for name in SETTINGS}


def add_check(name: str, check: Callable[[Any], Any]) -> None:
    """Have ``check(value)`` (raising ValueError) validate setting ``name`` too, at configure time: for checks
    that live above this module (the topology names of tokenring.sim.topology)."""
    _setting(name)
    _checks.setdefault(name, []).append(check)


def on_change(fn: Callable[[str], None]) -> None:
    """Call ``fn(name)`` whenever :func:`configure` changes a setting (caches that depend on one)."""
    _listeners.append(fn)
