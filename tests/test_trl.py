"""TRL on gloo ranks with a small Llama (float32): SequenceParallelSFTTrainer and SequenceParallelDPOTrainer over
a (dp, cp) mesh log the loss and metrics, and reach the gradients, of the stock trainer in one process on the
same global batch (1e-4 relative); what cannot be made exact raises ValueError when the trainer is built."""

import pytest

pytest.importorskip("trl")

import hf_cases  # noqa: E402
import trl_cases  # noqa: E402

TOL = 1e-4


def _scale(log: dict, key: str) -> float:
    """What an error in ``key`` is measured against: rewards are differences of log-probabilities (relative to
    the log-probabilities; beta = 0.5), the mean logits are near 0 (an absolute 1e-2)."""
    if key.startswith("rewards/"):
        return max(abs(log[key]), 0.5 * abs(log["logps/chosen"]))
    return max(abs(log[key]), 1e-2 if key.startswith("logits/") else 1e-6)


def _compare(got: dict, want: dict, keys: tuple[str, ...]) -> dict:
    """Relative errors of the logged values ``keys`` and the largest of the gradients'."""
    out = {k: abs(got["log"][k] - want["log"][k]) / _scale(want["log"], k) for k in keys}
    out["grad"] = max(hf_cases.rel(got["grads"][n], g) for n, g in want["grads"].items())
    return out


SFT_KEYS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


@pytest.mark.parametrize(
    "kind,P,dp",
    [("plain", 4, 2), ("completion", 2, 1), ("assistant", 4, 2), ("packing", 3, 1), ("padding_free", 4, 2)],
)
def test_sft_matches_one_process(pools, kind, P, dp):
    """Right-padded, completion-only, assistant-only, BFD-packed and padding-free batches of lengths no 2P
    splits."""
    got = pools(P).run(trl_cases.sft_step, dp, kind)[0]
    want = trl_cases.sft_run(kind, dp)
    err = _compare(got, want, SFT_KEYS)
    assert max(err.values()) < TOL, err


DPO_KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "entropy",
    "mean_token_accuracy",
    "logits/chosen",
    "num_tokens",
)


@pytest.mark.parametrize("loss,P,dp", [("sigmoid", 4, 2), ("mix", 2, 1), ("weighted", 3, 1)])
def test_dpo_matches_one_process(pools, loss, P, dp):
    """The policy and the reference both run sharded; chosen/rejected rows right-padded to one length. ``mix``
    (sigmoid + IPO + SFT, ld_alpha) and ``weighted`` (robust, WPO weighting) at dp=1: TRL's own DDP already
    differs from one process there for the token-mean SFT term."""
    got = pools(P).run(trl_cases.dpo_step, dp, loss)[0]
    want = trl_cases.dpo_run(loss, dp)
    err = _compare(got, want, DPO_KEYS)
    err["eval"] = abs(got["eval"]["eval_loss"] - want["eval"]["eval_loss"]) / abs(want["eval"]["eval_loss"])
    assert max(err.values()) < TOL, err


def test_unsupported_settings_are_refused(pools):
    for got in pools(2).run(trl_cases.refused):
        assert "label_smoothing_factor" in got["smoothing"], got
        assert "attn_implementation" in got["sdpa"], got
        assert "precompute_ref_log_probs" in got["precompute"], got
        assert "reference model" in got["ref_sdpa"], got
        assert "generate_batch" in got["grpo_batching"] and "entropy_coef=0" in got["grpo_entropy"], got
        assert "attn_implementation" in got["grpo_sdpa"] and "num_generations (2)" in got["grpo_groups"], got


@pytest.mark.parametrize("kind", ["completion", "padding_free"])
def test_sft_evaluate_matches_one_process(pools, kind):
    """evaluate() over a remainder batch at dp=2 x cp=2: one process's eval_loss on every rank."""
    want = trl_cases.sft_evaluate(kind)
    for got in pools(4).run(trl_cases.sft_evaluate_step, 2, kind):
        assert abs(got - want) <= TOL * abs(want), (got, want)


def _grpo_scale(log: dict, key: str) -> float:
    """What an error in ``key`` is measured against: the loss is a sum of advantage-weighted ratios near 1 whose
    advantages cancel (near 0 on policy: against 1e-2), the KL a square of log-ratios of a few 1e-2 (1e-3)."""
    return max(abs(log[key]), {"loss": 1e-2, "kl": 1e-3}.get(key, 1e-6))


@pytest.mark.parametrize(
    "setting,P,dp",
    [("grpo", 2, 1), ("dapo_old", 3, 1), ("dr_grpo_kl", 2, 1), ("bnpo_seq", 4, 1), ("cispo_accum", 2, 1)]
    + [
        ("sapo", 3, 1),
        ("luspo", 2, 1),
        ("vespo", 2, 1),
        ("grpo", 4, 2),
        ("dr_grpo_kl", 4, 2),
        ("vllm", 3, 1),
        ("grpo", 2, 2),
    ],
)
def test_grpo_matches_one_process(pools, tmp_path, setting, P, dp):
    """Two GRPO steps: rollouts generated over the sharded KV cache (sampled, top-k) equal one process's token
    for token, and the logged loss, grad norm, rewards and metrics, the last step's gradients and the parameters
    after it (SGD) agree (1e-4 relative); ``grpo`` at dp = 1 evaluates first, its metrics compared too. At dp = 2
    (cp = 2, and cp = 1) the reference is the stock trainer on 2 data-parallel ranks (each samples with its own
    seed, as GRPO seeds them). ``vllm``: use_vllm=True through TRL's vLLM seam, a stand-in that returns one
    process's rollouts on each cp group's rank 0 and other tokens on its other ranks."""
    path = str(tmp_path / "m")
    trl_cases.grpo_model(path)
    if dp == 1:
        want = trl_cases.grpo_run(setting, dp, path)
    else:
        want = pools(dp).run(trl_cases.grpo_step, dp, setting, path, None, True)[0]
    script = want["rollouts"] if setting == "vllm" else None
    got = pools(P).run(trl_cases.grpo_step, dp, setting, path, script)[0]
    assert got["completions"] == want["completions"]
    assert set(got["eval"]) == set(want["eval"]), set(got["eval"]) ^ set(want["eval"])  # (``grpo``: evaluate first)
    for k, w in want["eval"].items():
        if "time" not in k and "per_second" not in k and k != "epoch":
            assert abs(got["eval"][k] - w) <= TOL * _grpo_scale(want["eval"], k), (k, got["eval"][k], w)
    assert len(got["logs"]) == len(want["logs"]) == 2
    for g, w in zip(got["logs"], want["logs"]):
        assert set(g) == set(w), set(g) ^ set(w)
        keys = [k for k, v in w.items() if isinstance(v, float) and "time" not in k and k != "epoch"]
        err = {k: abs(g[k] - w[k]) / _grpo_scale(w, k) for k in keys}
        assert max(err.values()) < TOL, err
    grad = max(hf_cases.rel(got["grads"][n], g) for n, g in want["grads"].items())
    param = max(hf_cases.rel(got["params"][n], p) for n, p in want["params"].items())
    assert grad < TOL and param < TOL, (grad, param)


@pytest.mark.parametrize("family,P", [("qwen3", 2), ("qwen3_5", 2), ("bamba", 3)])
def test_grpo_families_match_one_process(pools, tmp_path, family, P):
    """GRPO (the ``grpo`` setting) on a Qwen3 and on hybrids (Gated DeltaNet; Mamba2), whose rollouts decode over
    the sharded cache with the mixers' states passed between ranks. Gradients within 1e-3 per parameter: a Gated
    DeltaNet's A_log and dt_bias gradients are sums cancelling to 1e-5 of the others, which state passing adds in
    another order (qwen3_5 at P=2: 1.9e-4 relative, 3e-9 absolute)."""
    path = str(tmp_path / "m")
    trl_cases.grpo_model(path, family)
    want = trl_cases.grpo_run("grpo", 1, path)
    got = pools(P).run(trl_cases.grpo_step, 1, "grpo", path)[0]
    assert got["completions"] == want["completions"]
    for g, w in zip(got["logs"], want["logs"], strict=True):
        keys = [k for k, v in w.items() if isinstance(v, float) and "time" not in k and k != "epoch"]
        err = {k: abs(g[k] - w[k]) / _grpo_scale(w, k) for k in keys}
        assert max(err.values()) < TOL, err
    grad = max(hf_cases.rel(got["grads"][n], g) for n, g in want["grads"].items())
    assert grad < 1e-3, grad
