"""Rank-side functions for tests/test_compile.py: a small Llama under ``torch.compile(fullgraph=True)`` against
the same model in eager mode, on each rank of a RankPool."""

from __future__ import annotations

import family_cases
import hf_cases

import tokenring.agreement as agreement
import tokenring.hf as thf

SMALL = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def _step(model, batch, call=None) -> tuple[float, dict]:
    """One step's global loss and summed gradients; ``call``: what runs the forward (the compiled module)."""
    model.zero_grad(set_to_none=True)
    out = (call if call is not None else model)(**batch)
    out.loss.backward()
    thf.all_reduce_grads(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return thf.reduce_loss(out.loss).item(), grads


def compiled_matches_eager(
    rank: int,
    P: int,
    S: int,
    strategy: str,
    docs: list[int] | None = None,
    arch: str = "llama",
    over: dict | None = None,
    layout: str = "zigzag",
    family: str | None = None,
    B: int = 1,
) -> dict:
    """Two training steps of ``torch.compile(model, fullgraph=True)`` (AOT autograd, so the custom ops' fake
    implementations and autograd formula are traced) vs eager: losses, gradients, graphs and graph breaks.
    ``family``: a float64 model of tests/family_cases.py instead of ``arch``; ``B`` rows."""
    import torch
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if family is not None:
        model = family_cases.build(family, "tokenring", dtype=torch.float64)
    else:
        model = hf_cases.build(arch, "tokenring", **{**SMALL, **(over or {})})
    ids = hf_cases.tokens(S, model.config.vocab_size, B)
    pos = hf_cases.packed_positions(docs).expand(B, S) if docs else None
    res = {}
    with thf.settings(strategy=strategy, layout=layout):
        batch = thf.shard_batch(ids, labels=ids, position_ids=pos)
        loss, grads = _step(model, batch)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        for i in range(2):  # the first call traces, the second reuses the graph
            closs, cgrads = _step(model, batch, compiled)
            res[f"loss{i}"] = abs(closs - loss) / abs(loss)
            res[f"grad{i}"] = max(hf_cases.rel(cgrads[n], g) for n, g in grads.items())
            res["same_grads"] = set(cgrads) == set(grads)
    res["frames"] = counter.frame_count
    res["breaks"] = sum(counters["graph_break"].values())
    return res


def checks_once_per_forward(rank: int, P: int, S: int, layers: int) -> dict:
    """How often a forward of a ``layers``-layer model reads its position ids (gathers them across ranks) and
    exchanges call signatures: the first forward once / once per distinct call, later ones not at all."""
    calls = {"positions": 0}
    import tokenring.hf.attention as hf_attention

    real = hf_attention._check_inputs

    def counted(*a, **kw):
        calls["positions"] += 1
        return real(*a, **kw)

    hf_attention._check_inputs = counted
    try:
        model = hf_cases.build("llama", "tokenring", **{**SMALL, "num_hidden_layers": layers})
        ids = hf_cases.tokens(S, model.config.vocab_size)
        res = {}
        with thf.settings(strategy="token_ring"):
            for i in range(3):
                batch = thf.shard_batch(ids, labels=ids)  # new tensors each step, as a data loader gives them
                before = dict(agreement._exchanges)
                calls["positions"] = 0
                model(**batch).loss.backward()
                res[i] = (calls["positions"], sum(agreement._exchanges.values()) - sum(before.values()))
        return res
    finally:
        hf_attention._check_inputs = real


def over_lengths(rank: int, P: int, batches: list, strategy: str, dynamic) -> dict:
    """``torch.compile(model, fullgraph=True, dynamic=dynamic)`` trained on batches of changing lengths (``(S,
    documents or None)`` each) vs eager: the worst relative loss / gradient error, graphs compiled (``frames``;
    ``graphs``: those with nodes, dynamic=True also compiles an empty one, as with PyTorch's own attention) and
    graph breaks. The length is symbolic after the first recompile: no graph per length."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = hf_cases.build("llama", "tokenring", **{**SMALL, "num_hidden_layers": 1})
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=dynamic)
    res = {"loss": 0.0, "grad": 0.0}
    with thf.settings(strategy=strategy):
        for S, docs in batches:
            ids = hf_cases.tokens(S, model.config.vocab_size)
            pos = hf_cases.packed_positions(docs) if docs else None
            batch = thf.shard_batch(ids, labels=ids, position_ids=pos)
            loss, grads = _step(model, batch)
            closs, cgrads = _step(model, batch, compiled)
            res["loss"] = max(res["loss"], abs(closs - loss) / abs(loss))
            res["grad"] = max(res["grad"], *(hf_cases.rel(cgrads[n], g) for n, g in grads.items()))
    res["frames"] = counter.frame_count
    res["graphs"] = sum(1 for g in counter.graphs if len(g.graph.nodes))
    res["breaks"] = sum(counters["graph_break"].values())
    return res


def refused_when_compiled(rank: int, P: int) -> dict:
    """Bad calls of a compiled ``tokenring.attention`` (fullgraph): an odd local length under zigzag, after a
    graph traced for a good one (dynamic shapes: checked in the op at run time), and ulysses over heads that do
    not divide over the ranks (refused by the plan at trace time, raised by the op): each refusal's type and
    message, eager's and compiled's."""
    import torch._dynamo

    from tokenring import attention

    def call(q, k, v, strategy):
        return attention(q, k, v, causal=True, strategy=strategy)

    def outcome(fn, *args) -> str:
        try:
            fn(*args)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "ran"

    def qkv(s, H):
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(1, s, H, 8, generator=g) for _ in range(3)]

    res = {}
    for name, dynamic, strategy, H, good, bad in (
        ("odd length", True, "token_ring", 4, 16, 15),
        ("heads", None, "ulysses", 3, None, 8),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        if good is not None:
            res[f"{name} good"] = outcome(compiled, *qkv(good, H), strategy)
        res[f"{name} eager"] = outcome(call, *qkv(bad, H), strategy)
        res[f"{name} compiled"] = outcome(compiled, *qkv(bad, H), strategy)
    return res


def decode_step_compiled(rank: int, P: int) -> dict:
    """A decode step's attention (no step check, sinks, a batch of 2 over 9 cached rows per rank) inside a function
    compiled with ``fullgraph=True``: graphs, breaks and the output against the same function run eagerly, for
    two steps' queries; and with the step check left on, the same result through a graph break."""
    import torch._dynamo

    import tokenring

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(rank)
    k, v = (torch.randn(2, 9, 2, 8, generator=g) for _ in range(2))
    q = torch.randn(2, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))

    def step(q, k, v, check=False):
        return tokenring.decode_attention(q * 2, k, v, check=check, sinks=sinks).sin()

    fast = torch.compile(step, fullgraph=True)
    diff = max(float((fast(x, k, v) - step(x, k, v)).abs().max()) for x in (q, q + 1))
    explained = torch._dynamo.explain(step)(q, k, v)
    checked = torch.compile(step)(q, k, v, True)
    return {
        "diff": diff,
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "checked": float((checked - step(q, k, v, True)).abs().max()),
    }
