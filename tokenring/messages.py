"""The one table of message kinds: what each kind carries, how it is tagged, drawn, costed and received.

Every reader of a message kind looks it up here: :func:`tokenring.schedules.payload` (tensor shapes and
dtypes), :mod:`tokenring.comm` (point-to-point tags), the timelines (flow and colour), the simulator (the
cost of handling an arrival) and the strategies' ``Ops.receive`` (what an arrival does). A new kind is one
new row.

Tensor specs name a row shape per message row ``n`` (``B`` batch, ``H`` query heads, ``Hkv`` K/V heads,
``d`` head dim, after narrowing to the message's head half):
- ``q``: (B, n, H, d) in the input dtype; ``kv``: (B, n, Hkv, d) in the input dtype;
- ``stat``: (B, H, n) row statistics (lse, delta) in the accumulator dtype;
- ``kv_acc``: (B, n, Hkv, d) in the accumulator dtype (a travelling dK/dV accumulator);
- ``uq`` / ``ukv``: Ulysses' head groups, (B, n, H/P, d) and (B, n, Hkv'/P, d), input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Kind", "KINDS", "FLOWS", "kind"]

# The two traffic flows of the TokenRing paper: inputs going out to be computed on, results coming home.
FLOWS = {"data": "#1f77b4", "results": "#ff7f0e"}


@dataclass(frozen=True)
class Kind:
    name: str
    tensors: tuple[str, ...]   # tensor specs, see the module docstring
    flow: str                  # "data" or "results"
    receive: str               # what an arrival does: "store", "merge", "add_dq", "add_dkv", "collect"
    handling: str | None       # simulator cost of that on the receiver: "merge", "add", "copy" or None
    doc: str

    @property
    def tag(self) -> int:
        """Index of this kind; :mod:`tokenring.comm` builds distinct point-to-point tags from it."""
        return _ORDER.index(self.name)

    @property
    def colour(self) -> str:
        return FLOWS[self.flow]


_ROWS = (
    Kind("q", ("q",), "data", "store", None, "queries travelling to the K/V they attend to (pass-Q)"),
    Kind("kv", ("kv", "kv"), "data", "store", None, "keys and values travelling to the queries (pass-KV)"),
    Kind("out", ("q", "stat"), "results", "merge", "merge", "a partial output and its lse, going home"),
    Kind("qgrad", ("q", "q", "stat", "stat"), "data", "store", None,
         "backward pass-Q: queries, dO, lse and delta"),
    Kind("dq", ("q",), "results", "add_dq", "add", "a partial dQ going home"),
    Kind("dkv", ("kv_acc", "kv_acc"), "results", "add_dkv", "add",
         "a dK/dV accumulator travelling from contributor to contributor, then home"),
    Kind("u_qkv", ("uq", "ukv", "ukv"), "data", "collect", None, "Ulysses: my rows of your Q/K/V head group"),
    Kind("u_out", ("uq",), "results", "collect", "copy", "Ulysses: your rows of my head group's output"),
    Kind("u_dout", ("uq",), "data", "collect", None, "Ulysses backward: my rows of your dO head group"),
    Kind("u_grad", ("uq", "ukv", "ukv"), "results", "collect", "copy",
         "Ulysses backward: your rows of my head group's dQ, dK, dV"),
)
_ORDER = [k.name for k in _ROWS]
KINDS: dict[str, Kind] = {k.name: k for k in _ROWS}


def kind(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown message kind {name!r}; known: {', '.join(KINDS)}") from None
