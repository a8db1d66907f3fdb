"""A schedule lowered for one rank: the step loop and the ``Ops``' decisions run once per signature, recorded as a
flat list of tensor operations and message posts, which every later call replays on its own tensors.

The executor (:func:`tokenring.executor.execute`) and the ``Ops`` (:mod:`tokenring.strategies.base`) decide per
call which stored piece a compute reads, which rows a partial merges into, what to allocate and when to post
and wait: the same answers for every call of one signature, and most of a small call's host time
(bench/results/host_overhead.md). Lowering runs that same code once with :class:`Ref` placeholders for
tensors, through a recording comm, and keeps what it did (:class:`Program`). A replay makes the same tensor
operations in the same order, so its results are the step loop's, bit for bit; tests compare the two
(``tokenring.instrument(step_loop=True)`` runs the loop). Slots no later operation reads are dropped as the
replay passes them, so a replay holds no more memory than the loop did.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

import torch

from . import settings
from .comm import Posting
from .executor import execute
from .merge import acc_dtype

__all__ = ["Ref", "Program", "lowered", "replay_on", "replayable", "run"]


class Ref:
    """A tensor the program holds at run time: slot ``slot`` (its item ``item`` where the slot holds a list),
    viewed through ``views`` (``(method, arguments)``: narrow, select, transpose, unsqueeze). Carries what the
    decisions read: shape, dtype, device."""

    __slots__ = ("slot", "item", "views", "shape", "dtype", "device")

    def __init__(self, slot: int, shape, dtype, device, item: int | None = None, views: tuple = ()):
        self.slot, self.item, self.views = slot, item, views
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device

    def _view(self, shape, method: str, *args) -> "Ref":
        return Ref(self.slot, shape, self.dtype, self.device, self.item, (*self.views, (method, args)))

    def narrow(self, dim: int, start: int, length: int) -> "Ref":
        if start == 0 and length == self.shape[dim]:  # the whole dimension: the tensor itself
            return self
        shape = list(self.shape)
        shape[dim] = length
        return self._view(shape, "narrow", dim, start, length)

    def select(self, dim: int, index: int) -> "Ref":
        shape = list(self.shape)
        del shape[dim]
        return self._view(shape, "select", dim, index)

    def transpose(self, a: int, b: int) -> "Ref":
        shape = list(self.shape)
        shape[a], shape[b] = shape[b], shape[a]
        return self._view(shape, "transpose", a, b)

    def unsqueeze(self, dim: int) -> "Ref":
        shape = list(self.shape)
        shape.insert(dim if dim >= 0 else len(shape) + dim + 1, 1)
        return self._view(shape, "unsqueeze", dim)


class _Refs(list):
    """The Refs of a slot that holds a list (a message's receive buffers)."""

    slot: int


class _Recorder:
    """The operations of one lowering, in order, each as a line of Python over slot variables ``v<n>``, with
    the slots it reads; constants (schedule messages, dtypes, shapes) in ``consts`` (``K[i]`` in the lines).
    Each view a line reads is made once, into a slot of its own, by a line before the first that reads it."""

    def __init__(self, n_inputs: int):
        self.lines: list[tuple[str, set]] = []
        self.consts: list = []
        self.slots = n_inputs
        self.viewed: dict[str, int] = {}  # a view's expression -> its slot

    def slot(self) -> int:
        self.slots += 1
        return self.slots - 1

    def text(self, x, reads: set) -> str:
        """``x`` as an expression: a Ref's slot (item, views), or a constant; its slot added to ``reads``."""
        if type(x) in (str, int, bool) or x is None:
            return repr(x)
        if not isinstance(x, Ref):
            self.consts.append(x)
            return f"K[{len(self.consts) - 1}]"
        expr, slot = f"v{x.slot}" if x.item is None else f"v{x.slot}[{x.item}]", x.slot
        for method, args in x.views:  # (a view costs a few microseconds per call: one per view and program)
            view = f"{expr}.{method}({', '.join(map(str, args))})"
            if view not in self.viewed:
                self.viewed[view] = self.slot()
                self.lines.append((f"v{self.viewed[view]} = {view}", {slot}))
            slot = self.viewed[view]
            expr = f"v{slot}"
        reads.add(slot)
        return expr

    def line(self, code: str, reads: set) -> None:
        self.lines.append((code, reads))

    def call(self, name: str, args: tuple, outs=None) -> None:
        """Record ``ops.<name>(*args)``; ``outs``: ``None`` (no result kept), a slot, or a tuple of slots."""
        reads: set = set()
        call = f"ops.{name}({', '.join(self.text(a, reads) for a in args)})"
        if outs is None:
            self.line(call, reads)
        elif isinstance(outs, int):
            self.line(f"v{outs} = {call}", reads)
        else:
            self.line(f"{', '.join(f'v{s}' for s in outs)} = {call}", reads)

    def new(self, name: str, args: tuple, *likes) -> Ref | tuple:
        """Record an operation returning tensors shaped like ``likes`` (``(shape, dtype, device)`` each)."""
        slots = tuple(self.slot() for _ in likes)
        self.call(name, args, slots[0] if len(slots) == 1 else slots)
        refs = tuple(Ref(s, *like) for s, like in zip(slots, likes))
        return refs[0] if len(refs) == 1 else refs


def _partial(q, v) -> tuple:
    """What a kernel call of ``q``'s rows against ``v``'s makes: ``(out, lse)`` as ``(shape, dtype, device)``."""
    B, n, H, _ = q.shape
    return ((B, n, H, v.shape[3]), q.dtype, q.device), ((B, H, n), acc_dtype(q.dtype), q.device)


class _Lowering:
    """The ``Ops``' tensor operations, recorded instead of run (mixed in ahead of an ``Ops`` class)."""

    rec: _Recorder

    def expand(self, t, g: int):
        B, n, h, d = t.shape
        return self.rec.new("expand", (t, g), ((B, n, h * g, d), t.dtype, t.device))

    def zeros(self, shape, dtype):
        return self.rec.new("zeros", (tuple(shape), dtype), (shape, dtype, self.device))

    def add_(self, dst, src) -> None:
        self.rec.call("add_", (dst, src))

    def cast(self, t, dtype):
        return self.rec.new("cast", (t, dtype), (t.shape, dtype, t.device))

    def fold_heads(self, t, g: int):
        B, n, h, d = t.shape
        return self.rec.new("fold_heads", (t, g), ((B, n, h // g, d), t.dtype, t.device))

    def merge_into(self, how, acc_o, acc_lse, o, lse) -> None:
        self.rec.call("merge_into", (how, acc_o, acc_lse, o, lse))

    def alloc(self, specs):
        slot = self.rec.slot()
        self.rec.call("alloc", (specs,), slot)
        out = _Refs(Ref(slot, shape, dt, self.device, item=i) for i, (shape, dt, *_) in enumerate(specs))
        out.slot = slot
        return out

    def accumulator(self, dtype):
        sh, acc = self.sh, acc_dtype(dtype)
        return self.rec.new(
            "accumulator",
            (dtype,),
            ((sh.B, sh.s, sh.H, sh.d), acc, self.device),
            ((sh.B, sh.H, sh.s), acc, self.device),
        )

    def adopt(self, o, lse, dtype):
        acc = acc_dtype(dtype)
        return self.rec.new("adopt", (o, lse, dtype), (o.shape, acc, o.device), (lse.shape, acc, lse.device))

    def attend(self, c, q, k, v):
        return self.rec.new("attend", (c, q, k, v), *_partial(q, v))

    # inference's attention to rows (tokenring.extend.RowsTensors)
    def block(self, q, k, v, causal: bool):
        return self.rec.new("block", (q, k, v, causal), *_partial(q, v))

    def rows_accumulator(self, B: int, n: int, H: int, d: int, dtype):
        acc = acc_dtype(dtype)
        return self.rec.new(
            "rows_accumulator", (B, n, H, d, dtype), ((B, n, H, d), acc, self.device), ((B, H, n), acc, self.device)
        )

    def cat(self, dim: int, *ts):
        shape = list(ts[0].shape)
        shape[dim] = sum(t.shape[dim] for t in ts)
        return self.rec.new("cat", (dim, *ts), (shape, ts[0].dtype, ts[0].device))

    def joined(self, B: int, n: int, H: int, d: int, dtype, filled: bool = True):
        return self.rec.new("joined", (B, n, H, d, dtype, filled), ((B, n, H, d + 1), acc_dtype(dtype), self.device))

    def contiguous(self, t):
        return self.rec.new("contiguous", (t,), (t.shape, t.dtype, t.device))

    def take_rows(self, t, index):
        return self.rec.new("take_rows", (t, index), (t.shape, t.dtype, t.device))

    def head_groups(self, n: int, *ts):
        size = sum(math.prod(t.shape) // n for t in ts)
        return self.rec.new("head_groups", (n, *ts), ((n, size), ts[0].dtype, ts[0].device))

    def row_delta(self, dout, out):
        B, n, H, _ = out.shape
        return self.rec.new("row_delta", (dout, out), ((B, H, n), acc_dtype(out.dtype), out.device))

    def join(self, o, lse):
        B, n, H, d = o.shape
        return self.rec.new("join", (o, lse), ((B, n, H, d + 1), o.dtype, o.device))

    def merged(self, *joined):
        B, n, H, d1 = joined[0].shape
        dt, dev = joined[0].dtype, joined[0].device
        return self.rec.new("merged", joined, ((B, n, H, d1 - 1), dt, dev), ((B, H, n), dt, dev))

    def attend_backward(self, c, dout, q, k, v, lse, delta, out=None):
        return self.rec.new(
            "attend_backward",
            (c, dout, q, k, v, lse, delta, out),
            (q.shape, q.dtype, q.device),
            (k.shape, k.dtype, k.device),
            (v.shape, v.dtype, v.device),
        )


class _Pending:
    """A recorded step's messages due at one step: waiting records the wait."""

    def __init__(self, rec: _Recorder, slot: int, due: int, recvs: list):
        self.rec, self.slot, self.due, self.recvs = rec, slot, due, recvs

    def wait(self) -> None:
        self.rec.line(f"v{self.slot}[{self.due}].wait()", {self.slot})


class _Comm:
    """A comm that records the step's posting (the real one posts at replay)."""

    def __init__(self, comm, rec: _Recorder):
        self.rank, self.early_receives, self.trace, self.rec = comm.rank, comm.early_receives, None, rec

    def start(self, step: int, sends: list, recvs: list) -> list[_Pending]:
        if not sends and not recvs:  # (the real comm posts nothing either)
            return []
        rec, slot, reads = self.rec, self.rec.slot(), set()
        sent = ", ".join(f"[{', '.join(rec.text(t, reads) for t in ts)}]" for _, ts, _ in sends)
        got = ", ".join(f"v{bufs.slot}" for _, bufs, _ in recvs)
        reads |= {bufs.slot for _, bufs, _ in recvs}
        specs = [[(tuple(t.shape), t.dtype) for t in ts] for _, ts, _ in sends]
        cpu = all(t.device.type == "cpu" for x in (sends, recvs) for _, ts, _ in x for t in ts)
        posting = Posting(step, [(m, at) for m, _, at in sends], [(m, at) for m, _, at in recvs], specs, cpu)
        rec.line(f"v{slot} = comm.post({rec.text(posting, reads)}, [{sent}], [{got}])", reads)
        got = [(m, bufs) for m, bufs, _ in recvs]  # (the posting's operations list the receives first)
        return [_Pending(rec, slot, due, [got[i] for i in idx if i < len(got)]) for due, idx, *_ in posting.dues]


class Program:
    """One rank's recorded run of a schedule, as the source of one Python function over slot variables
    (``source``, for reading; ``run`` is it compiled), with the constants it reads."""

    def __init__(self, source: str, consts: list):
        self.source, self.consts = source, consts
        scope: dict = {"K": consts}
        exec(compile(source, "<tokenring program>", "exec"), scope)
        self.run = scope["program"]  # run(inputs, ops, comm) -> the outputs' tensors


def _lower(ops_cls, build: Callable, outputs: Callable, sched, comm, inputs: list) -> Program:
    rec = _Recorder(len(inputs))
    refs = [None if t is None else Ref(i, t.shape, t.dtype, t.device) for i, t in enumerate(inputs)]

    def make(*args, cls=None, **kwargs):  # (the recorder is in place before __init__ records its allocations)
        low = _lowering_class(ops_cls if cls is None else cls)
        obj = low.__new__(low)
        obj.rec = rec
        obj.__init__(*args, **kwargs)
        return obj

    ops = build(make, refs)
    execute(sched, _Comm(comm, rec), ops)
    outs = outputs(ops)
    returned: set = set()
    ret = f"return [{', '.join(rec.text(r, returned) for r in outs)}]"
    keep = returned | set(range(len(inputs)))
    last: dict[int, int] = {}
    for i, (_, reads) in enumerate(rec.lines):
        for slot in reads:
            last[slot] = i
    dead: list[list[int]] = [[] for _ in rec.lines]
    for slot, i in last.items():
        if slot not in keep:
            dead[i].append(slot)
    body = [f"{', '.join(f'v{i}' for i in range(len(inputs)))}, = inputs"]
    for (line, _), gone in zip(rec.lines, dead):
        body.append(line)
        body += [f"v{slot} = None" for slot in sorted(gone)]  # no later line reads it: free it now
    body.append(ret)
    source = "def program(inputs, ops, comm):\n" + "".join(f"    {line}\n" for line in body)
    return Program(source, rec.consts)


_classes: dict = {}


def _lowering_class(ops_cls):
    if ops_cls not in _classes:
        _classes[ops_cls] = type(f"Lowering{ops_cls.__name__}", (_Lowering, ops_cls), {})
    return _classes[ops_cls]


_programs: "OrderedDict[tuple, tuple]" = OrderedDict()  # key -> (schedule, program), least recent first
_MAX_PROGRAMS = 256


def replayable(hooks) -> bool:
    """Whether a call with these instruments replays a program (tracing, logs and ``step_loop`` take the loop)."""
    return hooks.trace is None and hooks.comm_log is None and hooks.held_log is None and not hooks.step_loop


def _full_key(key: tuple, sched, comm, ops) -> tuple:
    return (type(ops), id(sched), comm.rank, comm.early_receives, *key)


def lowered(key: tuple, sched, comm, ops) -> Program | None:
    """The program :func:`run` lowered for these arguments, if it has (``None`` where it has not, or dropped it)."""
    hit = _programs.get(_full_key(key, sched, comm, ops))
    return hit[1] if hit is not None and hit[0] is sched else None


def replay_on(prog: Program, comm, ops, inputs: list, group) -> list:
    """``prog`` replayed on ``group`` through ``comm``, which a cached replay keeps without a group between calls
    (a cache keeps no group alive), with the timeout as set now."""
    comm.group, comm.timeout = group, settings.get("timeout")
    try:
        return prog.run(inputs, ops, comm)
    finally:
        comm.group = None


def run(key: tuple, sched, comm, ops, inputs: list, build: Callable, outputs: Callable) -> list:
    """Run this rank's part of ``sched`` on ``inputs`` as a replay of its program, lowered at the first call of
    ``key`` (what the decisions depend on besides the schedule); ``ops``: the call's ``Ops`` for the tensor
    operations (:meth:`tokenring.strategies.base._OpsBase.runner`). ``build(make, refs)``: the recording
    ``Ops`` over the inputs' Refs, made by ``make(*ops_args)`` (``make(*args, cls=C)``: an ``Ops`` of class ``C``
    that records alike, for strategies whose ``Ops`` nest); ``outputs(ops)``: the Refs whose tensors to return."""
    full = _full_key(key, sched, comm, ops)
    hit = _programs.get(full)
    if hit is None or hit[0] is not sched:  # (an id reused by another schedule)
        hit = (sched, _lower(type(ops), build, outputs, sched, comm, inputs))
        _programs[full] = hit
        if len(_programs) > _MAX_PROGRAMS:
            _programs.popitem(last=False)
    else:
        _programs.move_to_end(full)
    return hit[1].run(inputs, ops, comm)
