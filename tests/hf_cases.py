"""Rank-side functions for tests/test_hf.py (run by a RankPool: ``fn(rank, P, *args)``).

A small Llama-architecture model (random weights from a config, never the hub) runs with
``attn_implementation="tokenring"`` on each rank's zigzag shard; rank 0 also runs the very same weights with
transformers' own ``sdpa`` attention on the whole sequence in one process and compares logits, loss and every
parameter gradient.
"""

from __future__ import annotations

import time

import torch

import tokenring
import tokenring.hf as thf

LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)


# transformers' own attention the single-process reference runs with (sdpa cannot take gpt-oss' sinks)
REF_ATTN = {"gpt_oss": "eager"}


def build(arch: str = "llama", attn: str = "tokenring", seed: int = 0, **over):
    import transformers

    cfg_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    }[arch]
    if arch == "gpt_oss":  # attention sinks, alternating sliding (window 32) / full layers, 4 experts
        over = {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32, **over}
        attn = REF_ATTN.get(arch, "sdpa") if attn == "sdpa" else attn
    cfg = getattr(transformers, cfg_cls)(**{**LLAMA, **over})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    if arch == "gpt_oss":  # sinks are left uninitialised by _from_config: give them values that matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, cfg.num_attention_heads))
    return model


def tokens(S: int, vocab: int, B: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """(1, S) position ids of documents of these lengths packed one after another (each restarting at 0), as
    transformers' DataCollatorWithFlattening makes them."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def model_matches(
    rank: int,
    P: int,
    S: int,
    strategies: list[str],
    arch: str = "llama",
    over: dict | None = None,
    train: bool = True,
    docs: list[int] | None = None,
) -> dict:
    """Logits (forward) and one training step's loss and parameter gradients of the sharded model vs rank 0's
    single-process sdpa run. ``docs``: document lengths packed into the sequence (position ids restarting per
    document; transformers masks them apart in the single-process run). Returns rank 0's errors and timings."""
    over = over or {}
    model = build(arch, "tokenring", **over)
    ids = tokens(S, model.config.vocab_size)
    pos = packed_positions(docs) if docs else None
    res: dict = {}
    if rank == 0:
        ref = build(arch, "sdpa", **over)
        ref.load_state_dict(model.state_dict())
        t0 = time.perf_counter()
        out = ref(input_ids=ids, labels=ids, use_cache=False, position_ids=pos)
        if train:
            out.loss.backward()
        res["single_s"] = time.perf_counter() - t0
        ref_logits, ref_loss = out.logits.detach(), out.loss.detach()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for strategy in strategies:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with thf.settings(strategy=strategy):
            batch = thf.shard_batch(ids, labels=ids if train else None, position_ids=pos)
            out = model(**batch)
            if train:
                out.loss.backward()
                thf.all_reduce_grads(model)
                loss = thf.reduce_loss(out.loss)
        logits = thf.gather_logits(out.logits)
        res[f"{strategy}_s"] = time.perf_counter() - t0
        if rank == 0:
            e = dict(logits=(logits - ref_logits).abs().max().item())
            if train:
                e["loss"] = abs(loss.item() - ref_loss.item())
                e["grad"], e["worst"] = max((rel(p.grad, ref_grads[n]), n) for n, p in model.named_parameters())
            res[strategy] = e
    return res


def plain_path(rank: int, P: int, S: int, strategy: str) -> float:
    """The documented plain path: shard input_ids and position_ids with tokenring.shard, call the model with
    them, gather the logits; returns max |logits - single-process logits| (rank 0; others 0)."""
    model = build("llama", "tokenring")
    ids = tokens(S, model.config.vocab_size)
    local_ids = tokenring.shard(ids, dim=1, layout="zigzag")
    local_pos = tokenring.shard(torch.arange(S)[None], dim=1, layout="zigzag")
    with torch.no_grad(), thf.settings(strategy=strategy):
        logits = model(input_ids=local_ids, position_ids=local_pos).logits
    full = tokenring.gather(logits, dim=1, layout="zigzag")
    if rank:
        return 0.0
    ref = build("llama", "sdpa")
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    return (full - want).abs().max().item()


def refusals(rank: int, P: int, S: int) -> dict:
    """Each unsupported input must raise ValueError on every rank (never hang); returns the messages."""
    model = build("llama", "tokenring", num_hidden_layers=1)
    ids = tokens(S, model.config.vocab_size)
    batch = thf.shard_batch(ids)
    msgs = {}
    with torch.no_grad():
        baseline = model(**batch).logits

    def expect(name, fn):
        try:
            fn()
        except ValueError as e:
            msgs[name] = str(e)
        else:
            raise AssertionError(f"rank {rank}: {name} was not refused")
        with torch.no_grad():  # the refusal left nothing behind: the next plain forward is bit for bit the same
            if not torch.equal(model(**batch).logits, baseline):
                raise AssertionError(f"rank {rank}: a forward after the {name} refusal differs")

    with torch.no_grad():
        # padding on one rank's shard only: every rank must refuse
        mask = torch.ones_like(batch["input_ids"])
        if rank == P - 1:
            mask[:, -3:] = 0
        expect("padding", lambda: model(**batch, attention_mask=mask))
        holed = torch.ones_like(ids)
        holed[:, 5:8] = 0  # pads between real tokens: no documents say what a token after them sees
        expect("padding_full", lambda: thf.shard_batch(ids, attention_mask=holed))
        left = torch.ones_like(ids)
        left[:, :3] = 0  # left padding, labels on every real token: the last pad would predict the first one
        expect("pad_target", lambda: thf.shard_batch(ids, labels=ids, attention_mask=left))
        # all-ones mask is fine
        model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))
        # missing position_ids (transformers would number local tokens 0..s-1)
        expect("positions", lambda: model(input_ids=batch["input_ids"]))
        # decoding with a KV cache over a sharded sequence
        expect(
            "cache",
            lambda: model(
                input_ids=batch["input_ids"][:, :2],
                position_ids=batch["position_ids"][:, :2],
                use_cache=True,
                cache=model(**{**batch, "use_cache": True}).past_key_values,
            ),
        )
        # packed rows that pack differently: shard_batch refuses them, and so do the layers given them directly
        ids2 = tokens(S, model.config.vocab_size, B=2)
        pos2 = torch.cat([packed_positions([S // 2, S // 2]), packed_positions([S // 4, 3 * S // 4])])
        expect("packing_batch", lambda: thf.shard_batch(ids2, position_ids=pos2))
        two = {k: tokenring.shard(t, 1, "zigzag") for k, t in (("input_ids", ids2), ("position_ids", pos2))}
        expect("packing", lambda: model(**two, use_cache=False))
        # dropout
        drop = build("llama", "tokenring", num_hidden_layers=1, attention_dropout=0.1).train()
        expect("dropout", lambda: drop(**batch))
        # unequal local lengths (a hand-made split): named as such on every rank, never a gloo abort
        s = batch["input_ids"].shape[1]
        n = 2 * s if rank == 0 else s
        expect("lengths", lambda: model(input_ids=ids[:, :n], position_ids=torch.arange(n)[None] + rank * s))
        # ranks of one group fed different samples (a per-rank sampler): caught by shard_batch(verify=True)
        other = tokens(S, model.config.vocab_size, seed=10 + rank)
        expect("samples", lambda: thf.shard_batch(other, labels=other, verify=True))
        thf.shard_batch(ids, labels=ids, verify=True)  # the same samples pass
    return msgs


def generate_matches(
    rank: int,
    P: int,
    S: int,
    new_tokens: int,
    arch: str = "llama",
    over: dict | None = None,
    sample: bool = False,
    B: int = 1,
    seed_per_rank: bool = False,
) -> dict:
    """``tokenring.hf.prefill`` + ``model.generate`` over the sharded cache vs rank 0's single-process
    ``generate`` with transformers' own cache (same weights, same seed): generated ids, max |logits| difference
    over every step, and the cache bytes this rank holds vs the single process's. ``seed_per_rank``: each rank
    seeds its sampling differently (rank 0 as the single process)."""
    over = over or {}
    model = build(arch, "tokenring", **over).eval()
    ids = tokens(S, model.config.vocab_size, B=B)
    kw = dict(
        max_new_tokens=new_tokens,
        do_sample=sample,
        top_k=20 if sample else None,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    t0 = time.perf_counter()
    cache = thf.prefill(model, ids)
    t1 = time.perf_counter()
    torch.manual_seed(1234 + (rank if seed_per_rank else 0))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
    t2 = time.perf_counter()
    res = dict(
        tokens=out.sequences[:, S:].tolist(),
        cache_bytes=cache.nbytes(),
        prefill_s=t1 - t0,
        decode_s=(t2 - t1) / new_tokens,
        held=[layer.keys.shape[2] for layer in cache.layers],
    )
    if rank == 0:
        ref = build(arch, "sdpa", **over).eval()
        ref.load_state_dict(model.state_dict())
        torch.manual_seed(1234)
        t0 = time.perf_counter()
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        res["single_s"] = time.perf_counter() - t0
        res["want"] = want.sequences[:, S:].tolist()
        res["logits"] = max((a - b).abs().max().item() for a, b in zip(out.logits, want.logits))
        res["single_cache_bytes"] = sum(
            layer.keys.numel() * layer.keys.element_size() * 2 for layer in want.past_key_values.layers
        )
    return res


def multiturn_matches(
    rank: int,
    P: int,
    turns: list[tuple[int, int]],
    arch: str = "llama",
    over: dict | None = None,
    strategy: str | None = None,
    B: int = 1,
) -> dict:
    """A chat of several turns over one ``ShardedCache``: ``turns[0] = (prompt, generated)`` goes through
    ``prefill`` + ``generate``, every later ``(user, generated)`` through ``extend`` (the user's tokens appended
    to the conversation) + ``generate``; rank 0 runs the same conversation in one process with transformers'
    own attention, each turn's ``generate`` over the whole conversation so far. Greedy ids per turn (both),
    the largest logits difference, and the shares of the cache every rank holds."""
    model = build(arch, "tokenring", **(over or {})).eval()
    V = model.config.vocab_size
    kw = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    convo, cache, got, logits, log = None, None, [], [], []
    for i, (user, n) in enumerate(turns):
        said = tokens(user, V, B=B, seed=10 + i)
        convo = said if convo is None else torch.cat([convo, said], dim=1)
        if cache is None:
            cache = thf.prefill(model, convo)
            cache.log = log
        else:
            thf.extend(model, cache, convo, strategy=strategy)
        with torch.no_grad():
            out = model.generate(convo, attention_mask=torch.ones_like(convo), cache=cache, max_new_tokens=n, **kw)
        got.append(out.sequences[:, convo.shape[1] :].tolist())
        logits.append(out.logits)
        convo = out.sequences
    res = dict(tokens=got, held=cache.layers[0].counts, strategies=sorted({x.get("strategy", "") for x in log}))
    if rank == 0:
        ref = build(arch, "sdpa", **(over or {})).eval()
        ref.load_state_dict(model.state_dict())
        convo, want, diff = None, [], 0.0
        for i, (user, n) in enumerate(turns):
            said = tokens(user, V, B=B, seed=10 + i)
            convo = said if convo is None else torch.cat([convo, said], dim=1)
            with torch.no_grad():
                out = ref.generate(convo, attention_mask=torch.ones_like(convo), max_new_tokens=n, **kw)
            want.append(out.sequences[:, convo.shape[1] :].tolist())
            diff = max(diff, max((a - b).abs().max().item() for a, b in zip(logits[i], out.logits)))
            convo = out.sequences
        res.update(want=want, logits=diff)
    return res


def generate_refusals(rank: int, P: int) -> dict:
    """Bad generation inputs raise ValueError on every rank: different prompts, a cache from another model, a
    rank feeding other tokens, caches out of step."""
    model = build("llama", "tokenring", num_hidden_layers=1).eval()
    msgs = {}
    ids = tokens(8 * P, model.config.vocab_size)
    try:
        thf.prefill(model, ids if rank else tokens(8 * P, model.config.vocab_size, seed=7))
    except ValueError as e:
        msgs["prompt"] = str(e)
    cache = thf.prefill(model, ids)
    other = build("llama", "tokenring", num_hidden_layers=1, num_key_value_heads=4).eval()
    try:
        other.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, pad_token_id=0)
    except ValueError as e:
        msgs["model"] = str(e)
    from transformers import LogitsProcessor, LogitsProcessorList

    class Shift(LogitsProcessor):  # rank 1 alone picks another token than the greedy one
        def __call__(self, input_ids, scores):
            return scores.roll(1, dims=-1)

    def run(shift: bool):
        procs = LogitsProcessorList([Shift()] if shift else [])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=thf.prefill(model, ids), max_new_tokens=3,
            pad_token_id=0, logits_processor=procs,
        )  # fmt: skip
        return out[:, ids.shape[1] :]

    before = run(False)
    try:
        run(rank == 1)
    except ValueError as e:
        msgs["tokens"] = str(e)
    stale = thf.prefill(model, ids)
    if rank == 2:  # a cache that holds a token more than the others' (generated on alone, say)
        stale.layers[0].total += 1
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=stale, max_new_tokens=2, pad_token_id=0)
    except ValueError as e:
        msgs["step"] = str(e)
    msgs["same_after"] = torch.equal(run(False), before)  # nothing left behind by the refused generate
    return msgs


def tiled_loss_matches(rank: int, P: int, S: int, chunk: int) -> dict:
    """``tokenring.hf.causal_lm_loss`` (head and loss tiled over ``chunk`` tokens) vs ``model(**batch).loss``
    on the same shards: the global loss and every gradient after the cross-rank sum."""
    model = build("llama", "tokenring", num_hidden_layers=2)
    ids = tokens(S, model.config.vocab_size)
    batch = thf.shard_batch(ids, labels=ids)
    got = {}
    for tiled in (False, True):
        model.zero_grad(set_to_none=True)
        loss = thf.causal_lm_loss(model, batch, chunk=chunk) if tiled else model(**batch).loss
        loss.backward()
        thf.all_reduce_grads(model)
        got[tiled] = (thf.reduce_loss(loss).item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (l0, g0), (l1, g1) = got[False], got[True]
    return dict(loss=abs(l1 - l0) / abs(l0), grad=max(rel(g1[n], g) for n, g in g0.items()))


def autocast_matches(rank: int, P: int, S: int, strategy: str) -> dict:
    """A float32 model under ``torch.autocast("cpu", bfloat16)``: the sharded global loss and gathered logits vs
    rank 0's single process (sdpa) under the same autocast; and the attention ran in bfloat16."""
    model = build("llama", "tokenring", num_hidden_layers=2)
    ids = tokens(S, model.config.vocab_size)
    seen = []
    import tokenring.api as api  # attention() calls the op (or, eager, the prepared call) by these names

    orig, orig_ready = api.attention_op, api.eager_ready

    def spy(q, *a, **kw):
        seen.append(q.dtype)
        return orig(q, *a, **kw)

    def spy_ready(ready, q, *a, **kw):
        seen.append(q.dtype)
        return orig_ready(ready, q, *a, **kw)

    api.attention_op, api.eager_ready = spy, spy_ready
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), thf.settings(strategy=strategy):
            batch = thf.shard_batch(ids, labels=ids)
            out = model(**batch)
            out.loss.backward()
            loss = thf.reduce_loss(out.loss).float()
            logits = thf.gather_logits(out.logits).float()
    finally:
        api.attention_op, api.eager_ready = orig, orig_ready
    res = dict(dtypes=sorted({str(d) for d in seen}))
    if rank == 0:
        ref = build("llama", "sdpa", num_hidden_layers=2)
        ref.load_state_dict(model.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref(input_ids=ids, labels=ids, use_cache=False)
        res["loss"] = abs(loss.item() - want.loss.float().item()) / abs(want.loss.float().item())
        res["logits"] = rel(logits, want.logits.float())
    return res


def extend_refusals(rank: int, P: int) -> dict:
    """Bad extend inputs raise ValueError on every rank: an edited earlier turn, nothing new, other tokens on
    one rank, another batch size."""
    model = build("llama", "tokenring", num_hidden_layers=1).eval()
    V = model.config.vocab_size
    ids = tokens(8 * P, V)
    cache = thf.prefill(model, ids)
    msgs = {}
    cases = {
        "edited": torch.cat([tokens(8 * P, V, seed=5), tokens(5, V)], dim=1),
        "nothing": ids,
        "ranks": torch.cat([ids, tokens(5, V, seed=rank)], dim=1),
        "batch": torch.cat([ids, tokens(5, V)], dim=1).expand(2, -1),
    }
    for name, convo in cases.items():
        try:
            thf.extend(model, cache, convo)
        except ValueError as e:
            msgs[name] = str(e)
    try:  # 4 query heads do not split over 3 ranks: refused, and the advised retry works
        thf.extend(model, cache, torch.cat([ids, tokens(5, V)], dim=1), strategy="ulysses")
    except ValueError as e:
        msgs["ulysses"] = str(e)
    thf.extend(model, cache, torch.cat([ids, tokens(5, V)], dim=1))  # and the cache still works
    msgs["held"] = cache.layers[0].total
    return msgs


def refused_generate_leaves_nothing(rank: int, P: int) -> float:
    """A generate refused mid-step (attention dropout in training mode: the cache's layer 0 has taken its step
    when the refusal comes), then a plain sharded forward of the same model in eval mode: max |logits - one
    process|."""
    model = build("llama", "tokenring", num_hidden_layers=2, attention_dropout=0.1).eval()
    ids = tokens(8 * P, model.config.vocab_size)
    cache = thf.prefill(model, ids)
    model.train()
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, pad_token_id=0)
        raise AssertionError("generate with attention dropout in training mode was not refused")
    except ValueError as e:
        assert "dropout" in str(e), e
    model.eval()
    logits = thf.gather_logits(model(**thf.shard_batch(ids)).logits)
    ref = build("llama", "sdpa", num_hidden_layers=2, attention_dropout=0.1).eval()
    ref.load_state_dict(model.state_dict())
    return (logits - ref(input_ids=ids, use_cache=False).logits).abs().max().item()


def generate_modes(rank: int, P: int, mode: str) -> dict:
    """Greedy generation over a sharded cache in a mode that used to fail, vs one process in the same mode:
    ``"contiguous"`` (prefill with layout="contiguous") or ``"autocast"`` (bf16 autocast on CPU). Returns the
    tokens and the largest logit difference relative to the largest logit."""
    import contextlib

    model = build("llama", "tokenring", num_hidden_layers=2).eval()
    ids = tokens(16 * P + 1, model.config.vocab_size)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    layout = "contiguous" if mode == "contiguous" else None
    with torch.no_grad(), amp:
        cache = thf.prefill(model, ids, layout=layout)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
        ref = build("llama", "sdpa", num_hidden_layers=2).eval()
        ref.load_state_dict(model.state_dict())
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return dict(
        tokens=out.sequences.tolist(),
        want=want.sequences.tolist(),
        logits=max(rel(a, b) for a, b in zip(out.logits, want.logits)),
    )


def any_length_matches(
    rank: int,
    P: int,
    lengths: list[int],
    rows: int = 1,
    pad: str | None = None,
    layout: str = "zigzag",
    pick: str | None = None,
) -> dict:
    """A batch of any length through shard_batch, vs one process (float32, the small Llama): ``rows`` = 1 packs
    documents of ``lengths`` into one row (position ids restarting, as DataCollatorWithFlattening makes it);
    ``pad`` ("right", "left"): one row per length, padded to the longest with a 2D attention mask (pad labels
    -100). ``pick``: under ``layout="auto"``, the placement the chooser answers (to reach each on small shapes).
    Returns the max |logits| difference over real tokens, the loss difference and the worst relative gradient."""
    from cases import forced_placement

    with forced_placement(pick):
        return _any_length_matches(rank, P, lengths, rows, pad, layout)


def _any_length_matches(rank: int, P: int, lengths: list[int], rows: int, pad, layout: str) -> dict:
    model = build("llama", "tokenring", num_hidden_layers=2)
    ref = build("llama", "sdpa", num_hidden_layers=2)
    ref.load_state_dict(model.state_dict())
    vocab = model.config.vocab_size
    if pad:
        S = max(lengths)
        ids = torch.randint(1, vocab, (len(lengths), S), generator=torch.Generator().manual_seed(4))
        n = torch.tensor(lengths)[:, None]
        mask = (torch.arange(S)[None] < n if pad == "right" else torch.arange(S)[None] >= S - n).long()
        labels = ids.masked_fill(mask == 0, -100)
        if pad == "left":  # the last pad would predict the first real token: no target there (shard_batch says)
            labels[torch.arange(len(lengths)), S - n[:, 0]] = -100
        pos = None
        want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    else:
        S = sum(lengths)
        ids = tokens(S, vocab, seed=4)
        pos = packed_positions(lengths)
        mask = None
        labels = ids.clone()
        labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100  # no target across documents
        want = ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    want.loss.backward()
    with thf.settings(layout=layout):
        batch = thf.shard_batch(ids, labels=labels, position_ids=pos, attention_mask=mask)
        out = model(**batch)
        out.loss.backward()
        thf.all_reduce_grads(model)
        loss = thf.reduce_loss(out.loss)
        logits = thf.gather_logits(out.logits, length=S, cu_seqlens=batch.get("cu_seq_lens_q"))
    real = mask.bool() if mask is not None else torch.ones(1, S, dtype=torch.bool)
    cu = batch.get("cu_seq_lens_q")
    Sp = batch["input_ids"].shape[1] * P
    placed = tokenring.layouts.resolve_layout(layout, Sp, P, cu)
    padded = torch.nn.functional.pad(ids, (0, Sp - S))
    return dict(
        placed=placed,
        held_as_placed=torch.equal(batch["input_ids"], tokenring.shard(padded, 1, placed, cu_seqlens=cu)),
        logits=(logits - want.logits.detach())[real].abs().max().item(),
        loss=abs(loss.item() - want.loss.item()),
        grad=max(rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
        local=batch["input_ids"].shape[1],
    )


def tiled_loss_keeps_head_hooks(rank: int, P: int) -> bool:
    """An instance-level forward on the head (what accelerate's hooks install) is the head's forward again after
    tokenring.hf.tiled_loss, and was called by the tiled loss inside it."""
    model = build("llama", "tokenring", num_hidden_layers=1)
    head = model.get_output_embeddings()
    calls = []
    plain = head.forward

    def hooked(h):
        calls.append(1)
        return plain(h)

    head.forward = hooked
    ids = tokens(8 * P, model.config.vocab_size)
    thf.causal_lm_loss(model, thf.shard_batch(ids, labels=ids), chunk=4).backward()
    return head.__dict__.get("forward") is hooked and len(calls) > 0


def large_ids(rank: int, P: int) -> dict:
    """Token ids near 2**63: shard_batch's batch check takes them (same ids everywhere), and refuses them on every
    rank when one rank's ids differ; the message of each."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(2**62, 2**63 - 1, (2, 8 * P), generator=gen)
    batch = thf.shard_batch(ids, labels=ids, verify=True)
    other = ids.clone()
    if rank == P - 1:
        other[0, 0] -= 1
    try:
        thf.shard_batch(other, labels=other, verify=True)
    except ValueError as e:
        return dict(shape=tuple(batch["input_ids"].shape), error=str(e))
    return dict(shape=tuple(batch["input_ids"].shape), error=None)


def widened_batch_refused(rank: int, P: int) -> dict:
    """Beam search and num_return_sequences > 1 over a sharded cache: a clear ValueError on every rank, and the
    same cache then generates greedily as one process does."""
    model = build("llama", "tokenring", num_hidden_layers=2).eval()
    ids = tokens(8 * P + 3, model.config.vocab_size)
    mask = torch.ones_like(ids)
    cache = thf.prefill(model, ids)
    msgs = []
    for kw in (dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)):
        try:
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, pad_token_id=0, **kw)
            raise AssertionError(f"generate({kw}) over a sharded cache was not refused")
        except ValueError as e:
            msgs.append(str(e))
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = build("llama", "sdpa", num_hidden_layers=2).eval()
    ref.load_state_dict(model.state_dict())
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return dict(msgs=msgs, same=out.tolist() == want.tolist())


def bidirectional_padding(rank: int, P: int) -> dict:
    """A BERT encoder (bidirectional attention) over a batch padded on the left, the right and both sides, rows
    of different lengths, sharded by shard_batch, vs the same model with sdpa in one process: the largest
    difference over real tokens of the last hidden states, and of the input embeddings' gradient."""
    import transformers

    def bert(attn: str):  # a config each: _from_config sets the implementation on the config it is given
        cfg = transformers.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.BertModel._from_config(cfg, attn_implementation=attn, dtype=torch.float64)

    model, ref = bert("tokenring"), bert("sdpa")
    ref.load_state_dict(model.state_dict())
    S = 23
    ids = torch.randint(1, 100, (4, S), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, S, dtype=torch.long)
    mask[0, 15:] = 0  # right
    mask[1, :4] = 0  # left
    mask[2, :2] = 0  # both
    mask[2, 19:] = 0
    w = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # (a plain sum would
    want = ref(input_ids=ids, attention_mask=mask).last_hidden_state  # reduce LayerNorm's output to its bias)
    (want @ w * mask).sum().backward()
    batch = thf.shard_batch(ids, attention_mask=mask)
    batch.pop("use_cache")
    out = model(**batch).last_hidden_state
    (out @ w * batch["attention_mask"]).sum().backward()
    full = tokenring.gather(out.detach(), 1, "zigzag")[:, :S]  # shard_batch's own padding dropped
    grad = model.embeddings.word_embeddings.weight.grad.clone()
    torch.distributed.all_reduce(grad)
    return dict(
        out=(full - want.detach())[mask.bool()].abs().max().item(),
        grad=rel(grad, ref.embeddings.word_embeddings.weight.grad),
    )
