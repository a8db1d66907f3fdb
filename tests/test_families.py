"""Every decoder family of the installed transformers (tests/family_cases.py), sharded at P = 2 and 3: one
training step equals transformers' own attention in one process, or the model is refused on every rank with a
ValueError naming its sequence-mixing layer and the model. Nothing silently in between. Also the detector of
such layers on plain modules, MLA generation, and the refusal under torch.compile."""

import pytest

pytest.importorskip("transformers")

import family_cases  # noqa: E402
import torch  # noqa: E402

from tokenring.mixers import find_mixers  # noqa: E402

# the families refused, with a word of the refusal; every other family must be exact
UNCOVERED = "State passing does not cover"  # hybrids whose mixer kind tokenring.recurrence does not cover
REFUSED = {"gemma2": "soft-capping", "jamba": UNCOVERED, "minimax": UNCOVERED, "zamba": UNCOVERED}
HYBRIDS = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5": "Qwen3_5GatedDeltaNet",
    "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "falcon_h1": "FalconH1Mixer",
    "bamba": "BambaMixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "jamba": "JambaMambaMixer",
    "nemotron_h": "NemotronHMamba2Mixer",
    "lfm2": "Lfm2ShortConv",
    "minimax": "MiniMaxLightningAttention",
    "zamba": "ZambaMambaMixer",
    "kimi_linear": "KimiLinearDeltaAttention",
}


@pytest.mark.parametrize("P", [2, 3])
def test_every_family_is_exact_or_refused_on_every_rank(pools, P):
    """One training step in float64 (transformers' own loss upcasts to float32, so the loss is taken in float64
    from the logits): logits and loss to 1e-9, every gradient to 1e-9 or 4x the one process's own floor."""
    names = list(family_cases.FAMILIES)
    assert len([n for n in names if "(" not in n]) >= 25 and set(HYBRIDS) <= set(names)
    per_rank = pools(P).run(family_cases.sweep, names, 12 * P)
    for i, name in enumerate(names):
        got = [r[i] for r in per_rank]
        first = got[0]
        if name in REFUSED:
            assert all(g["outcome"] == "refused" for g in got), (name, [g["outcome"] for g in got])
            assert all(REFUSED[name] in g["error"] for g in got), (name, first["error"])
        else:
            assert first["outcome"] == "exact", (name, first)
            assert all(g["outcome"] == "ran" for g in got[1:]), (name, [g["outcome"] for g in got])


@pytest.mark.parametrize("P", [2, 4])
def test_hybrids_unprepared_would_differ(pools, P):
    """The sweep's hybrids are a real test: left unprepared (their mixers on one shard), they differ."""
    names = ["qwen3_5", "bamba", "lfm2"]
    res = pools(P).run(family_cases.unprepared, names, 8 * P)[0]
    for name, r in zip(names, res):
        assert r["outcome"] == "differs" and r["logits"] > 1e-4, (name, r)


@pytest.mark.parametrize("P", [2, 3])
def test_mla_generate(pools, P):
    """DeepSeek-V3 (q/k head dim 24, v 16): sharded prefill, greedy generate, a next turn by extend (sharded at
    both P: 4P + 1 new tokens) and generate again give one process's tokens and logits."""
    res = pools(P).run(family_cases.generate_family, "deepseek_v3", 16 * P + 1, 5, 4 * P + 1)
    assert res[0]["outcome"] == "exact", res[0]
    assert all(r["tokens"] == res[0]["tokens"] for r in res)


# (family, P, prompt length, sampled, batch): Gated DeltaNet, Mamba2 (Falcon-H1's beside attention in one layer),
# convolutions; lengths that split over 2P and that leave a replicated rest
HYBRID_GENERATE = [
    ("qwen3_5", 2, 16, False, 1),
    ("qwen3_next", 3, 27, True, 2),
    ("bamba", 2, 19, True, 1),
    ("falcon_h1", 3, 24, False, 2),
    ("nemotron_h", 2, 21, False, 1),
    ("lfm2", 3, 25, True, 1),
    ("kimi_linear", 2, 19, True, 2),
]


@pytest.mark.parametrize("name,P,S,sample,batch", HYBRID_GENERATE)
def test_hybrid_generate(pools, name, P, S, sample, batch):
    """Hybrids generate over the sharded cache: prefill by state passing leaves every mixer's recurrent and
    convolution state on every rank; generate (greedy or sampled) and a next turn by extend give one process's
    tokens, on every rank. Uncovered kinds are refused in prefill on every rank."""
    res = pools(P).run(family_cases.generate_family, name, S, 4, 5, sample, batch)
    assert res[0]["outcome"] == "exact", res[0]
    assert all(r["tokens"] == res[0]["tokens"] for r in res)


def test_uncovered_hybrid_generate_is_refused(pools):
    res = pools(2).run(family_cases.generate_family, "jamba", 16, 3)
    assert all(r["outcome"] == "refused" and "JambaMambaMixer" in r["error"] for r in res), res
    assert all("recurrent and convolution states" in r["error"] for r in res), res


@pytest.mark.parametrize("P", [2, 3])
def test_uncovered_hybrids_replicated_when_asked(pools, P):
    """Jamba's Mamba1, Zamba's Mamba and MiniMax's lightning attention, which state passing does not cover, are
    exact when tokenring.hf.prepare(model, mixers="replicate") asks for them to run whole on every rank."""
    names = [n for n, why in REFUSED.items() if why == UNCOVERED]
    res = pools(P).run(family_cases.sweep, names, 12 * P, "float64", "replicate")[0]
    for name, r in zip(names, res):
        assert r["outcome"] == "exact", (name, r)


def test_compiled_hybrid_is_refused_unless_prepared(pools):
    """torch.compile traces the mask function, so the model is not prepared there: the documents op refuses at
    run time. After tokenring.hf.prepare(model), the compiled hybrid equals one process (float32: 1e-5)."""
    res = pools(2).run(family_cases.compiled_refusal, "lfm2")
    assert all("Lfm2ShortConv" in r and "tokenring.hf.prepare" in r for r in res), res
    for name in ("lfm2", "qwen3_5"):
        assert pools(2).run(family_cases.compiled_prepared, name)[0]["logits"] < 1e-5, name


def test_detector_on_plain_modules():
    """By what a layer is: a Conv1d with a kernel > 1, an A_log / dt_bias recurrence, a mixer's class name; not
    GPT-2's Conv1D (a linear layer), a kernel-1 Conv1d, or a tower governed by another config."""
    from transformers import GPT2Config, PretrainedConfig
    from transformers.pytorch_utils import Conv1D

    class Recurrence(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(2))
            self.conv1d = torch.nn.Conv1d(4, 4, 4, groups=4)

    class LightningAttention(torch.nn.Module):
        pass

    class Block(torch.nn.Module):
        def __init__(self, mixer):
            super().__init__()
            self.mixer, self.proj = mixer, torch.nn.Linear(4, 4)

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = PretrainedConfig()
            self.patch = torch.nn.Conv1d(4, 4, 3)

    class Model(torch.nn.Module):
        def __init__(self, *layers):
            super().__init__()
            self.config = GPT2Config()
            self.layers = torch.nn.ModuleList(layers)

    kinds = {m.type_name: m.kind for m in find_mixers(Model(Block(Recurrence()), Block(torch.nn.Conv1d(4, 4, 3))))}
    assert kinds == {"Recurrence": "state-space / gated-delta recurrence", "Block": "short causal convolution"}
    assert [m.type_name for m in find_mixers(Model(Block(LightningAttention())))] == ["LightningAttention"]
    plain = Model(Block(Conv1D(4, 4)), Block(torch.nn.Conv1d(4, 4, 1)), Tower())
    assert find_mixers(plain) == []
    by_config = Model(Block(torch.nn.Identity()))
    by_config.config.layer_types = ["full_attention", "linear_attention"]
    assert [m.where for m in find_mixers(by_config)] == [["layer 1"]]


def _layouts(P: int) -> list:
    """(layout, document lengths, batch rows, right pads of row 1): packed documents that split over no 2P (placed
    by a planner at the even or odd P), a single padded sequence, and zigzag_docs' multiples of 2P."""
    return [
        ("zigzag", [5 * P, 7 * P + 1, 4 * P - 1], 2, 0),
        ("contiguous", [3 * P + 2, 9 * P - 2], 1, 0),
        ("balanced" if P % 2 == 0 else "whole_docs", [6 * P + 3, 5 * P - 3, 5 * P], 2, 0),
        ("zigzag_docs", [2 * P * 3, 2 * P * 5], 1, 0),
        ("zigzag", [16 * P], 2, 5),
        ("auto", [4 * P + 1, 9 * P, 3 * P - 1], 1, 0),
    ]


@pytest.mark.parametrize(
    "name,P",
    [("bamba", 1), ("qwen3_5", 2), ("bamba", 3), ("nemotron_h", 4), ("lfm2", 5), ("kimi_linear", 3)],
)
def test_hybrid_layouts_packing_and_batches(pools, name, P):
    """A hybrid sharded by state passing in every layout, over packed documents (the states start again at each,
    also on one rank), B = 2 and a right-padded row: logits and loss vs one process running each document alone,
    to the float32 scans' rounding (1e-6, 1e-8), every gradient to 4x the one process's own floor or float32's
    1e-5 (the Mamba2 scans run in float32 in a float64 model: A_log's gradient, a sum over every token, moved
    5e-6 at nemotron_h P=4)."""
    for layout, docs, B, pad in _layouts(P):
        r = pools(P).run(family_cases.hybrid_batch, name, layout, docs, B, pad)[0]
        assert r["logits"] < 1e-6 and r["loss"] < 1e-8, (layout, docs, r)
        assert r["grad"] <= max(1e-5, 4 * r["floor"]), (layout, docs, r)
