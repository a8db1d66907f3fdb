"""What tests and benchmarks record about, or force on, the calls in a block: not part of the public call.

    with tokenring.instrument(comm_log=log, trace=tokenring.comm.Trace(rank)):
        tokenring.attention(q, k, v).sum().backward()

A forward keeps the instrumentation it started with for its backward, wherever the backward runs. Eager mode
only (a traced graph cannot carry Python objects into the op).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

__all__ = ["Instruments", "instrument", "current"]


@dataclass(frozen=True)
class Instruments:
    trace: object = None  # tokenring.comm.Trace: filled with timeline events
    comm_log: list | None = None  # receives (pass, per-message byte records) of forward and backward
    held_log: list | None = None  # receives (pass, bytes of visiting data held after each step)
    backward_kernel: str = "auto"  # kernels.block_backward backend: "auto", "math", "cpu_flash", "cuda"
    stage: bool | str | None = None  # Comm's host staging (None: on gloo; "always": CPU tensors too)
    expand_kv: bool | None = None  # repeat K/V heads once per stored block (None: where the kernel needs it)
    timeout: float | None = None  # this call's bound on a wait for a peer (None: the timeout setting)
    step_loop: bool = False  # run schedules by the executor's step loop, not their recorded programs


NONE = Instruments()
_stack: list[Instruments] = []  # a plain global, which torch.compile can read while tracing (a ContextVar it cannot)


@contextlib.contextmanager
def instrument(**fields):
    """Within this block, :func:`tokenring.attention` calls record / force ``fields`` (see :class:`Instruments`)."""
    _stack.append(Instruments(**fields))
    try:
        yield _stack[-1]
    finally:
        _stack.pop()


def current() -> Instruments | None:
    return _stack[-1] if _stack else None
