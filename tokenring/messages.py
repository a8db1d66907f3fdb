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
- ``uq`` / ``ukv``: Ulysses' head groups, (B, n, H/P, d) and (B, n, Hkv'/P, d), input dtype;
- ``pos``: (n,) int64 global positions of cached rows (extend under a window or documents).

Inference sizes its buffers by the uneven shards of its cache (:mod:`tokenring.extend`), kinds as here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Kind", "KINDS", "FLOWS", "Flow", "Receive", "Handling", "kind"]


class Flow(StrEnum):
    """The two traffic flows of the TokenRing paper: inputs going out to be computed on, results coming home."""

    DATA = "data"
    RESULTS = "results"


class Receive(StrEnum):
    """What an arrival does on the receiver."""

    STORE = "store"  # kept for the computes that need it
    MERGE = "merge"  # merged into the owner's output accumulator (a partial out + lse)
    ADD_DQ = "add_dq"  # added into the owner's dQ
    ADD_DKV = "add_dkv"  # added into a travelling or home dK/dV accumulator
    COLLECT = "collect"  # an all-to-all piece, placed by the strategy (Ulysses)


class Handling(StrEnum):
    """What handling an arrival costs the receiver, for the simulator."""

    MERGE = "merge"
    ADD = "add"
    COPY = "copy"


FLOWS = {Flow.DATA: "#1f77b4", Flow.RESULTS: "#ff7f0e"}


@dataclass(frozen=True)
class Kind:
    name: str
    tensors: tuple[str, ...]  # tensor specs, see the module docstring
    flow: Flow
    receive: Receive
    handling: Handling | None  # None: nothing to do beyond landing in its buffer
    doc: str

    @property
    def tag(self) -> int:
        """Index of this kind; :mod:`tokenring.comm` builds distinct point-to-point tags from it."""
        return _ORDER.index(self.name)

    @property
    def colour(self) -> str:
        return FLOWS[self.flow]


_ROWS = (
    Kind("q", ("q",), Flow.DATA, Receive.STORE, None, "queries travelling to the K/V they attend to (pass-Q)"),
    Kind("kv", ("kv", "kv"), Flow.DATA, Receive.STORE, None, "keys and values travelling to the queries (pass-KV)"),
    Kind("out", ("q", "stat"), Flow.RESULTS, Receive.MERGE, Handling.MERGE, "a partial output and its lse, going home"),
    Kind(
        "qgrad",
        ("q", "q", "stat", "stat"),
        Flow.DATA,
        Receive.STORE,
        None,
        "backward pass-Q: queries, dO, lse and delta",
    ),
    Kind("dq", ("q",), Flow.RESULTS, Receive.ADD_DQ, Handling.ADD, "a partial dQ going home"),
    Kind(
        "dkv",
        ("kv_acc", "kv_acc"),
        Flow.RESULTS,
        Receive.ADD_DKV,
        Handling.ADD,
        "a dK/dV accumulator travelling from contributor to contributor, then home",
    ),
    Kind("pos", ("pos",), Flow.DATA, Receive.STORE, None, "cached rows' global positions, travelling with K/V"),
    Kind("u_qkv", ("uq", "ukv", "ukv"), Flow.DATA, Receive.COLLECT, None, "Ulysses: my rows of your Q/K/V head group"),
    Kind(
        "u_out", ("uq",), Flow.RESULTS, Receive.COLLECT, Handling.COPY, "Ulysses: your rows of my head group's output"
    ),
    Kind("u_dout", ("uq",), Flow.DATA, Receive.COLLECT, None, "Ulysses backward: my rows of your dO head group"),
    Kind(
        "u_grad",
        ("uq", "ukv", "ukv"),
        Flow.RESULTS,
        Receive.COLLECT,
        Handling.COPY,
        "Ulysses backward: your rows of my head group's dQ, dK, dV",
    ),
)
_ORDER = [k.name for k in _ROWS]
KINDS: dict[str, Kind] = {k.name: k for k in _ROWS}


def kind(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown message kind {name!r}; known: {', '.join(KINDS)}") from None
