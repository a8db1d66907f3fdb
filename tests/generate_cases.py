"""Rank-side functions for tests/test_generate.py (run by a RankPool: ``fn(rank, P, *args)``): batched
generation from left-padded prompts of different lengths over a sharded cache, against rank 0's single process
(the same weights, transformers' own attention and cache, ``generate(input_ids, attention_mask=mask)``).
"""

from __future__ import annotations

import torch
from hf_cases import REF_ATTN, build

import tokenring.hf as thf

PAD = 0


def left_padded(lengths: list[int], vocab: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (B, max length) of prompts of these lengths padded on the left, as
    a tokenizer with ``padding_side="left"`` makes them (real tokens never the pad id)."""
    S = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), S), generator=g)
    mask = (torch.arange(S)[None] >= torch.tensor([S - n for n in lengths])[:, None]).to(torch.int64)
    return ids.masked_fill(mask == 0, PAD), mask


def _kw(new_tokens: int, sample: bool) -> dict:
    return dict(
        max_new_tokens=new_tokens,
        do_sample=sample,
        top_k=20 if sample else None,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=PAD,
        eos_token_id=None,
    )


def padded_generate(
    rank: int, P: int, lengths: list[int], new_tokens: int, sample: bool, arch: str = "llama", over: dict | None = None
) -> dict:
    """``prefill(model, ids, attention_mask=mask)`` + ``generate`` over the sharded cache: this rank's generated
    ids; on rank 0 also one process's ids and the largest |logits| difference over every step and row."""
    over = {"num_hidden_layers": 2, **(over or {})}
    model = build(arch, "tokenring", **over).eval()
    ids, mask = left_padded(lengths, model.config.vocab_size)
    S, kw = ids.shape[1], _kw(new_tokens, sample)
    cache = thf.prefill(model, ids, attention_mask=mask)
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, **kw)
    # no layer still holds the K/V from before its last step (kept only until the step's checks pass)
    res = dict(tokens=out.sequences[:, S:].tolist(), kept=sum("_before" in vars(layer) for layer in cache.layers))
    if rank == 0:
        ref = build(arch, REF_ATTN.get(arch, "sdpa"), **over).eval()
        ref.load_state_dict(model.state_dict())
        torch.manual_seed(1234)
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=mask, **kw)
        res["want"] = want.sequences[:, S:].tolist()
        res["logits"] = max((a - b).abs().max().item() for a, b in zip(out.logits, want.logits))
    return res


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "not refused"


def padded_refusals(rank: int, P: int) -> dict:
    """What a sharded cache cannot follow, refused with a ValueError on every rank: right padding and holes
    in the prompt, masks that differ between ranks, a padded prompt under a document layout, a generate whose
    mask does not pad as the prefill's did (the cache left as it was: generating with the right mask afterwards
    gives one process's tokens), a padded generate over an unpadded prefill, and extend of a padded cache."""
    model = build("llama", "tokenring", num_hidden_layers=1).eval()
    ids, mask = left_padded([9, 16, 4], model.config.vocab_size)
    kw = _kw(3, False)
    right = mask.flip(1)
    hole = mask.clone()
    hole[0, 10] = 0
    other = mask.clone()
    other[2, -5] = 1  # rank 1 gives row 2 one real token more
    msgs = dict(
        right=_refusal(lambda: thf.prefill(model, ids, attention_mask=right)),
        hole=_refusal(lambda: thf.prefill(model, ids, attention_mask=hole)),
        ranks=_refusal(lambda: thf.prefill(model, ids, attention_mask=other if rank == 1 else mask)),
        layout=_refusal(lambda: thf.prefill(model, ids, attention_mask=mask, layout="balanced")),
    )
    cache = thf.prefill(model, ids, attention_mask=mask)
    held = [(layer.total, layer.skip) for layer in cache.layers]
    with torch.no_grad():
        msgs["unpadded_generate"] = _refusal(
            lambda: model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
        )
        msgs["other_generate"] = _refusal(lambda: model.generate(ids, attention_mask=other, cache=cache, **kw))
        msgs["kept"] = [(layer.total, layer.skip) for layer in cache.layers] == held
        msgs["extend"] = _refusal(lambda: thf.extend(model, cache, torch.cat([ids, ids[:, -4:]], 1)))
        got = model.generate(ids, attention_mask=mask, cache=cache, **kw).sequences
        ref = build("llama", "sdpa", num_hidden_layers=1).eval()
        ref.load_state_dict(model.state_dict())
        msgs["after"] = got.tolist() == ref.generate(ids, attention_mask=mask, **kw).sequences.tolist()
        plain = thf.prefill(model, ids)
        msgs["padded_generate"] = _refusal(lambda: model.generate(ids, attention_mask=mask, cache=plain, **kw))
    return msgs
