"""Random calls of tokenring.hf's public API, valid and invalid, for tests/test_fuzz_sample.py (a CI sample) and
bench/fuzz.py (the long run, ``--api hf``): ``shard_batch`` into the HF attention layers (a training step),
``prefill`` + ``generate``, and ``prefill`` + ``generate`` + ``extend`` + ``generate``, on small float64 models
of four families (Llama; Qwen2 with q/k/v biases; Mistral with a sliding window; gpt-oss with sinks, a window on
every other layer and experts), any length, batches of 1-2 rows, padded on either side or packed, every flat
strategy and the two plain layouts, greedy or sampled generation. Rules checked:

- a valid call equals the same model (same weights, transformers' own attention and cache) in one process,
  float64: logits within 1e-9 relative to the reference's largest logit, every parameter gradient within 1e-9
  relative to that parameter's largest reference gradient (or 1e-6, for gradients that are 0 in theory), the
  loss within 2e-6 relative (transformers computes it in float32, for a float64 model too); generated ids equal
  on every rank and equal to one process's, with ranks seeded differently;
- an invalid call raises a ValueError on every rank; the settings and the model's parameters are unchanged
  after it, and the valid call after it still equals one process (the group stays usable). Every invalid kind
  here is one the library promises to catch on every rank: inputs wrong on every rank, or different between
  ranks where an agreement check covers them (prompts, conversations, ``verify=True`` samples).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
import torch.distributed as dist
from hf_cases import REF_ATTN, build
from refusal_cases import differ, settings_state

import tokenring.hf as thf
from tokenring.strategies import ALIASES, FAMILIES, HIERARCHICAL, why_not
from tokenring.strategies.extend import STRATEGIES as EXTEND_STRATEGIES

H = 4  # query heads of every model (hidden 64, head dim 16; gpt-oss: head dim 32)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H, vocab_size=97)
ARCHS = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": 5},
    "gpt_oss": {"sliding_window": 6, "intermediate_size": 32},
}
KINDS = ("train", "train", "generate", "extend")
INVALID = (
    "shard_hole", "shard_pad_target", "shard_mask_shape", "shard_labels_shape", "shard_samples_one_rank",
    "shard_packings_differ", "strategy_unknown", "layout_unknown", "prefill_1d", "prefill_prompt_one_rank",
    "prefill_right_pad", "prefill_hole", "extend_edited", "extend_one_rank", "extend_shorter", "extend_padded",
    "extend_unknown_strategy", "generate_beam", "generate_mask_mismatch",
)  # fmt: skip
TOL = 1e-9
LOSS_TOL = 2e-6  # transformers computes the loss in float32 even for a float64 model, in one process too


def _strategies(P: int, Hkv: int) -> list[str]:
    names = [f for f in FAMILIES if f not in HIERARCHICAL] + list(ALIASES) + ["auto"]
    if P % 2 == 0 and P > 2:
        names += [f"usp:n={P // 2}", f"double_ring:n={P // 2}", f"token_ring_2d:n={P // 2}"]
    return [n for n in names if n == "auto" or why_not(n, H, Hkv, P) is None]


def _rows(rng: random.Random, B: int, top: int) -> list[int]:
    return [rng.randint(1, top) for _ in range(B)]


def draw(rng: random.Random, P: int, kind: str | None = None) -> dict:
    """One valid call at P ranks (of ``kind``, or one drawn)."""
    Hkv = rng.choice([1, 2, 4])
    case = dict(
        kind=kind or rng.choice(KINDS), arch=rng.choice(list(ARCHS)), Hkv=Hkv, seed=rng.randrange(2**16),
        strategy=rng.choice(_strategies(P, Hkv)), layout=rng.choice(["zigzag", "contiguous"]), B=rng.randint(1, 2),
    )  # fmt: skip
    if case["kind"] == "train":
        case["form"] = rng.choice(["plain", "left", "right", "packed"])
        if case["form"] == "packed":
            case["B"], case["lengths"] = 1, _rows(rng, rng.randint(2, 4), 4 * P)
        elif case["form"] == "plain":
            case["lengths"] = [rng.randint(1, 12 * P)] * case["B"]
        else:
            case["lengths"] = _rows(rng, case["B"], 12 * P)
    elif case["kind"] == "generate":
        padded = case["B"] > 1 and rng.random() < 0.7
        case["lengths"] = _rows(rng, case["B"], 8 * P + 3) if padded else [rng.randint(1, 8 * P + 3)] * case["B"]
        case.update(padded=padded, new=rng.randint(1, 4), sample=rng.random() < 0.4)
    else:
        case.update(
            lengths=[rng.randint(1, 6 * P)] * case["B"], new=rng.randint(1, 3), turn=rng.randint(1, 6 * P),
            new2=rng.randint(1, 3), extend=rng.choice([None, "auto", *_extend_ok(P, Hkv)]),
        )  # fmt: skip
    return case


def _extend_ok(P: int, Hkv: int) -> list[str]:
    return [s for s in EXTEND_STRATEGIES if s != "ulysses" or (H % P == 0 and Hkv % P == 0)]


def draw_calls(seed: int, P: int, n: int, invalid_share: float = 0.25) -> list[dict]:
    """``n`` calls: valid cases, and invalid ones (a valid case with ``invalid`` naming what is wrong in it)."""
    rng = random.Random(seed * 1000 + P)
    out = []
    for _ in range(n):
        if rng.random() < invalid_share:
            bad = rng.choice(INVALID)
            out.append(dict(draw(rng, P, CARRIER[bad]), invalid=bad))
        else:
            out.append(draw(rng, P))
    return out


class Models:
    """Each (family, K/V heads) model this rank builds once: the tokenring one and its one-process twin."""

    def __init__(self):
        self.built: dict = {}

    def get(self, arch: str, Hkv: int):
        if (arch, Hkv) not in self.built:
            over = {**SMALL, **ARCHS[arch], "num_key_value_heads": Hkv}
            model = build(arch, "tokenring", **over).double().eval()
            ref = build(arch, REF_ATTN.get(arch, "sdpa"), **over).double().eval()
            ref.load_state_dict(model.state_dict())
            if arch == "gpt_oss":  # transformers' grouped_mm experts take no float64
                model.set_experts_implementation("eager")
                ref.set_experts_implementation("eager")
            self.built[arch, Hkv] = model, ref
        return self.built[arch, Hkv]


def _ids(case: dict, V: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) ids and attention mask of ``case``'s rows: padded on the left (generate, ``left``) or the right."""
    lengths = case["lengths"]
    S = max(lengths) if case.get("form") != "packed" else sum(lengths)
    B = len(lengths) if case.get("form") != "packed" else 1
    g = torch.Generator().manual_seed(case["seed"] + salt)
    ids = torch.randint(1, V, (B, S), generator=g)
    n = torch.tensor(lengths if B == len(lengths) else [S])[:, None]
    left = case.get("form") == "left" or case.get("padded")
    mask = (torch.arange(S)[None] >= S - n) if left else (torch.arange(S)[None] < n)
    return ids.masked_fill(~mask, 0), mask.long()


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor).clamp_min(1e-300)).item() if b.numel() else 0.0


def _train(case: dict, model, ref, P: int, bad: str | None = None) -> float:
    """One forward + backward through shard_batch vs one process; the worst relative error."""
    ids, mask = _ids(case, model.config.vocab_size)
    B, S = ids.shape
    labels, pos = ids.masked_fill(mask == 0, -100), None
    if case["form"] == "left":
        labels[torch.arange(B), S - torch.tensor(case["lengths"])] = -100  # the last pad predicts no target
    if case["form"] == "packed":
        pos = torch.cat([torch.arange(n) for n in case["lengths"]])[None]
        labels[0, torch.cumsum(torch.tensor([0] + case["lengths"][:-1]), 0)] = -100  # none across documents
    use_mask = mask if case["form"] in ("left", "right") else None
    kw = dict(labels=labels, position_ids=pos, attention_mask=use_mask)
    if bad in ("shard_hole", "shard_pad_target"):  # a pad between real tokens; a left pad predicting a token
        L = max(S, 3)
        ids = torch.randint(1, model.config.vocab_size, (B, L))
        hole = torch.ones_like(ids).index_fill_(1, torch.tensor([L // 2 if bad == "shard_hole" else 0]), 0)
        kw = dict(labels=ids, attention_mask=hole)
    elif bad == "shard_mask_shape":
        kw["attention_mask"] = torch.ones(B, S + 1, dtype=torch.long)
    elif bad == "shard_labels_shape":
        kw["labels"] = labels[:, :-1] if S > 1 else torch.zeros(B, 2, dtype=torch.long)
    elif bad == "shard_samples_one_rank":
        ids = ids if dist.get_rank() else (ids + 1) % model.config.vocab_size
        kw.update(labels=ids, verify=True)
    elif bad == "shard_packings_differ":
        ids = torch.randint(1, model.config.vocab_size, (2, 4))  # two rows packed differently
        kw = dict(position_ids=torch.tensor([[0, 1, 0, 1], [0, 1, 2, 0]]))
    elif bad == "strategy_unknown":
        with thf.settings(strategy="tokenring_fastest"):
            pass
    elif bad == "layout_unknown":
        with thf.settings(layout="diagonal"):
            pass
    model.zero_grad(set_to_none=True)
    with thf.settings(strategy=case["strategy"], layout=case["layout"]):
        batch = thf.shard_batch(ids, **kw)
        out = model(**batch)
        out.loss.backward()
        thf.all_reduce_grads(model)
        loss = thf.reduce_loss(out.loss)
        logits = thf.gather_logits(out.logits, length=S, cu_seqlens=batch.get("cu_seq_lens_q"))
    ref.zero_grad(set_to_none=True)
    want = _reference(ref, ids, labels, use_mask, case)
    want.loss.backward()
    real = mask.bool() if use_mask is not None else torch.ones(B, S, dtype=torch.bool)
    scale = want.logits.detach()[real].abs().max()
    if abs(loss.item() - want.loss.item()) > LOSS_TOL * abs(want.loss.item()):
        raise AssertionError(f"loss {loss.item()!r}, one process {want.loss.item()!r}")
    errs = [((logits - want.logits.detach())[real].abs().max() / scale).item()]
    errs += [_rel(p.grad, q.grad, 1e-6) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
    return max(errs)


def _reference(ref, ids, labels, mask, case: dict):
    """One process's logits and loss; packed documents each run alone (transformers' eager attention, which the
    gpt-oss reference runs, does not read the documents from position ids)."""
    if case["form"] != "packed":
        return ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ends = torch.tensor(case["lengths"]).cumsum(0).tolist()
    logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip([0, *ends], ends)], 1)
    return SimpleNamespace(logits=logits, loss=ref.loss_function(logits, labels, vocab_size=ref.config.vocab_size))


def _generate_kw(new: int, sample: bool) -> dict:
    return dict(
        max_new_tokens=new, do_sample=sample, top_k=20 if sample else None, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip


def _generate(case: dict, model, ref, P: int, bad: str | None = None) -> float:
    """prefill + generate vs one process's generate (rank r > 0 seeded apart from rank 0 and the reference)."""
    rank = dist.get_rank()
    ids, mask = _ids(case, model.config.vocab_size)
    pmask = mask if case["padded"] else None
    kw = _generate_kw(case["new"], case["sample"])
    with thf.settings(strategy=case["strategy"], layout=case["layout"]):
        if bad == "prefill_1d":
            thf.prefill(model, ids[0])
        elif bad == "prefill_prompt_one_rank":
            thf.prefill(model, ids if rank != 1 else ids % (model.config.vocab_size - 1) + 1)
        elif bad in ("prefill_right_pad", "prefill_hole"):
            L = max(ids.shape[1], 3)
            wrong = torch.ones(1, L, dtype=torch.long)
            wrong[0, -1 if bad == "prefill_right_pad" else L // 2] = 0
            thf.prefill(model, torch.randint(1, model.config.vocab_size, (1, L)), attention_mask=wrong)
        cache = thf.prefill(model, ids, attention_mask=pmask)
        if bad == "generate_beam":
            model.generate(ids, attention_mask=mask, cache=cache, **{**kw, "num_beams": 2, "do_sample": False})
        elif bad == "generate_mask_mismatch":  # one pad more than prefill was given (or any, where it had none)
            first = int(mask[0].nonzero()[0]) if case["padded"] else 0
            model.generate(ids, attention_mask=mask.clone().index_fill_(1, torch.tensor([first]), 0), cache=cache, **kw)
        torch.manual_seed(case["seed"] + 7919 * rank)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, **kw)
    torch.manual_seed(case["seed"])
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, **kw)
    if not torch.equal(out.sequences, want.sequences):
        raise AssertionError(f"rank {rank}: generated {out.sequences.tolist()}, one process {want.sequences.tolist()}")
    return max(_rel(a, b) for a, b in zip(out.logits, want.logits))


def _extend(case: dict, model, ref, P: int, bad: str | None = None) -> float:
    """prefill + generate, a new turn through extend, generate again, vs one process over the conversation."""
    rank = dist.get_rank()
    V = model.config.vocab_size
    ids, mask = _ids(case, V)
    turn = _ids(dict(case, lengths=[case["turn"]] * case["B"]), V, salt=1)[0]
    kw1, kw2 = _generate_kw(case["new"], False), _generate_kw(case["new2"], False)
    with torch.no_grad(), thf.settings(strategy=case["strategy"], layout=case["layout"]):
        cache = thf.prefill(model, ids)
        first = model.generate(ids, attention_mask=mask, cache=cache, **kw1)
        convo = torch.cat([first.sequences, turn], 1)
        if bad == "extend_edited":
            thf.extend(model, cache, torch.cat([(first.sequences + 1) % V, turn], 1))
        elif bad == "extend_one_rank":
            thf.extend(model, cache, convo if rank != P - 1 else torch.cat([first.sequences, (turn + 1) % V], 1))
        elif bad == "extend_shorter":
            thf.extend(model, cache, first.sequences[:, : ids.shape[1]])
        elif bad == "extend_unknown_strategy":
            thf.extend(model, cache, convo, strategy="pass_everything")
        elif bad == "extend_padded":  # a cache prefilled from left-padded prompts
            two = torch.randint(1, V, (2, max(ids.shape[1], 2)))
            pads = torch.ones_like(two)
            pads[0, 0] = 0
            padded = thf.prefill(model, two, attention_mask=pads)
            thf.extend(model, padded, torch.cat([two, two], 1))
        thf.extend(model, cache, convo, strategy=case["extend"])
        second = model.generate(convo, attention_mask=torch.ones_like(convo), cache=cache, **kw2)
        got = second.sequences
        want1 = ref.generate(ids, attention_mask=mask, **kw1)
        want = ref.generate(torch.cat([want1.sequences, turn], 1), attention_mask=torch.ones_like(convo), **kw2)
    if not torch.equal(got, want.sequences):
        raise AssertionError(f"rank {rank}: conversation {got.tolist()}, one process {want.sequences.tolist()}")
    return max(_rel(a, b) for a, b in zip([*first.logits, *second.logits], [*want1.logits, *want.logits]))


RUN = {"train": _train, "generate": _generate, "extend": _extend}
# which valid kind carries each invalid one (the invalid input is made from that kind's inputs)
CARRIER = {k: "train" for k in INVALID if k.startswith(("shard_", "strategy_", "layout_"))}
CARRIER |= {k: "generate" for k in INVALID if k.startswith(("prefill_", "generate_"))}
CARRIER |= {k: "extend" for k in INVALID if k.startswith("extend_")}


def _everyone(flag: bool) -> list[bool]:
    t = torch.tensor([int(flag)])
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [bool(p.item()) for p in parts]


def run_calls(rank: int, P: int, calls: list[dict]) -> list[dict]:
    """Every call on this rank: ``{"kind", "err" or "message"}``. A wrong result, a missing refusal or one rank's
    failure raises on every rank (so the pool reports the case, and no rank waits on the others)."""
    models, out = Models(), []
    for call in calls:
        model, ref = models.get(call["arch"], call["Hkv"])
        bad = call.get("invalid")
        before = (settings_state(), {n: p.detach().clone() for n, p in model.named_parameters()})
        problem, res = None, None
        try:
            res = RUN[call["kind"]](call, model, ref, P, bad)
            if bad is not None:
                problem = f"{bad} was not refused"
        except ValueError as e:
            res = str(e)
            if bad is None:
                problem = f"a valid call was refused: {e}"
        except Exception as e:  # noqa: BLE001 - every rank stops on it below
            problem = f"{type(e).__name__}: {e}"
        if problem is None and bad is None and res > TOL:
            problem = f"relative error {res:.3g} > {TOL}"
        if problem is None and bad is not None:
            after = (settings_state(), {n: p.detach() for n, p in model.named_parameters()})
            if (where := differ(before, after)) is not None:
                problem = f"{bad}: the refusal changed {where}"
        failed = _everyone(problem is not None)
        if any(failed):
            raise AssertionError(
                f"rank {rank}/{P} {call}: {problem or f'rank(s) {[r for r, f in enumerate(failed) if f]} failed'}"
            )
        out.append(dict(kind=bad or "valid", err=res if bad is None else 0.0, message=res if bad else None))
    return out
