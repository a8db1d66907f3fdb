"""Prefill of new tokens over a persistent sharded cache (``tokenring.extend``, ``tokenring.hf.extend``): every
schedule exact against a float64 single-process reference for uneven cached shards in shuffled positions,
queries and keys of different lengths, MHA/GQA, odd head dims, windows and documents, fewer new tokens than
ranks; bad steps raise on every rank; bytes match the formulas; the simulator's choice moves from pass-Q to
the alternatives as the new tokens outgrow the cache; multi-turn chats give one process's ids.
Tolerances: float64 1e-9, float32 1e-5, bfloat16 2e-2 (relative to the reference's max)."""

import cases
import hf_cases
import pytest

from tokenring.extend import STRATEGIES, Shards, split_new
from tokenring.sim.extend import candidates, simulate_extend
from tokenring.sim.kernel_model import kernel_model
from tokenring.sim.topology import get_topology
from tokenring.tools.launch import spawn

TOL = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 2e-2}

CASES = [
    dict(B=1, n=37, T=9, H=4, Hkv=4, d=8, dtype="float64"),
    dict(B=2, n=50, T=13, H=8, Hkv=2, d=12, dtype="float32", seed=3),
    dict(B=1, n=41, T=11, H=4, Hkv=2, d=6, dtype="float64", window=9, seed=4),
    dict(B=1, n=30, T=10, H=4, Hkv=2, d=6, dtype="float64", cu_seqlens=[0, 20, 35, 40], seed=5),
    dict(B=1, n=20, T=2, H=4, Hkv=4, d=8, dtype="float64", seed=6),  # fewer new tokens than ranks
    dict(B=1, n=0, T=15, H=6, Hkv=3, d=5, dtype="float64", seed=7),  # an empty cache: chunked prefill
    dict(B=1, n=64, T=7, H=4, Hkv=1, d=16, dtype="bfloat16", seed=8, scale=-0.3),
    dict(B=2, n=45, T=17, H=4, Hkv=2, d=8, dtype="float64", seed=9, batch_rows=3),  # pass_q: several groups
    dict(B=1, n=33, T=10, H=8, Hkv=4, d=8, dtype="float32", seed=10, sinks=True),  # gpt-oss' attention sinks
]


def test_split_new_keeps_shards_balanced():
    assert split_new([5, 5, 5], 4) == [(0, 2), (2, 3), (3, 4)]
    assert split_new([6, 5, 5], 4) == [(0, 1), (1, 3), (3, 4)]
    for counts, T in (([0, 0, 0, 0], 7), ([9, 8, 9], 5), ([1], 3), ([3, 4, 4, 3], 2)):
        ranges = split_new(counts, T)
        assert ranges[0][0] == 0 and ranges[-1][1] == T
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
        after = [c + b - a for c, (a, b) in zip(counts, ranges)]
        assert max(after) - min(after) <= max(1, max(counts) - min(counts))
        if T >= len(counts):
            assert all(b > a for a, b in ranges)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_extend_matches_reference(pools, P):
    for strategy in STRATEGIES:
        for i, case in enumerate(CASES):
            if strategy == "ulysses" and (case["H"] % P or case["Hkv"] % P):
                continue
            if P == 5 and strategy not in ("pass_q", "pass_kv"):  # keep the run short (the others at P <= 4)
                continue
            case = dict(case, strategy=strategy)
            got = pools(P).run(cases.extend_case, case) if P > 1 else [cases.extend_case(0, 1, case)]
            for err in got:
                assert err < TOL[case["dtype"]], (strategy, case, err)


@pytest.mark.parametrize("P", [2, 3])
def test_later_layers_replay_straight_from_their_memo(pools, P):
    """A model's later layers (``shards=``, ``state=None``): from the third such call of a signature on, the call
    goes straight to its program's replay (``extend._repeats``), with the first call's bits (a scale below 0
    folded, bf16, ranks without new tokens, batched visitors); sinks and ulysses take the long way each time."""
    for strategy in STRATEGIES:
        for i, case in enumerate((CASES[0], CASES[1], CASES[4], CASES[6], CASES[7], CASES[8])):
            if strategy == "ulysses" and (case["H"] % P or case["Hkv"] % P):
                continue
            case = dict(case, strategy=strategy, later=True, seed=100 + i)
            for err in pools(P).run(cases.extend_case, case):
                assert err < TOL[case["dtype"]], (strategy, case, err)


@pytest.mark.parametrize("P", [3, 4])
def test_extend_replay_equals_step_loop(pools, P):
    """Without a window or documents, an extend schedule runs as a recorded program (lowered at the first call,
    replayed after): the step loop's bits, for every strategy, uneven shards, batched visitors, B=2, sinks."""
    for strategy in STRATEGIES:
        for case in (CASES[0], CASES[1], CASES[4], CASES[5], CASES[7], CASES[8]):
            if strategy == "ulysses" and (case["H"] % P or case["Hkv"] % P):
                continue
            for err in pools(P).run(cases.extend_case, dict(case, strategy=strategy, replay=True)):
                assert err < TOL[case["dtype"]], (strategy, case, err)


def test_extend_runs_as_a_program(pools):
    """The replay above is not vacuous: a plain extend records a program on every rank; a window does not."""
    assert pools(3).run(cases.extend_programs, False) == [1] * 3
    assert pools(3).run(cases.extend_programs, True) == [0] * 3


def test_extend_auto_is_exact_and_agreed(pools):
    for err in pools(3).run(cases.extend_case, dict(CASES[1], strategy="auto")):
        assert err < 1e-5


def test_extend_mismatch_raises_on_every_rank(pools):
    for msg in pools(3).run(cases.extend_mismatch, "heads"):
        assert "query heads" in msg and "rank 0" in msg, msg
    for msg in pools(3).run(cases.extend_mismatch, "ranges"):
        assert "do not tile" in msg, msg


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_extend_bytes_match_the_formula(pools, strategy):
    for got, want in pools(3).run(cases.extend_bytes_case, strategy):
        assert got == want, (strategy, got, want)


def _shards(P: int, N: int, T: int) -> Shards:
    counts = [N // P] * P
    ranges = split_new(counts, T)
    return Shards(tuple(c + b - a for c, (a, b) in zip(counts, ranges)), tuple(ranges))


def test_simulator_prefers_pass_q_for_few_new_tokens_and_not_for_many():
    """pass-Q while the new tokens are few next to the cache (it moves a few MB, pass-KV the whole cache), and
    not once they outnumber it 4:1 over slow links (GQA makes queries heavier than keys): on 8 H100s (64/8
    heads, d=128, bf16, a 1M cache) and on the 300 Mbit/s mesh testbed (P=4, 8/2 heads, d=64, fp32)."""
    h100 = get_topology("h100-nvswitch-8", 8)
    sh = _shards(8, 1 << 20, 1024)
    res = {s: simulate_extend(s, sh, 1, 64, 8, 128, 2, h100, kernel_model("h100")) for s in candidates(8, 64, 8)}
    assert min(res, key=lambda s: res[s].time).startswith("pass_q"), res
    assert res["pass_kv"].bytes_in > 5 * res["pass_q"].bytes_in
    mesh = get_topology("mesh:300mbit", 4)
    km = kernel_model("cpu", 1, share=0.5)
    pick = {}
    for N, T in ((65536, 512), (4096, 16384)):
        res = {s: simulate_extend(s, _shards(4, N, T), 1, 8, 2, 64, 4, mesh, km) for s in candidates(4, 8, 2)}
        pick[N, T] = min(res, key=lambda s: res[s].time)
    assert pick[65536, 512].startswith("pass_q") and not pick[4096, 16384].startswith("pass_q"), pick


@pytest.mark.parametrize(
    "P,turns,over,strategy",
    [
        (2, [(40, 5), (17, 4), (9, 3)], {}, None),
        (3, [(41, 5), (23, 4), (1, 3)], {}, "pass_kv"),  # 2 new tokens at the last turn: one decode step
        (4, [(64, 3), (33, 4), (19, 3)], {"num_key_value_heads": 4}, "ulysses"),
        (4, [(64, 3), (35, 4), (21, 3)], {}, "pass_q"),
        (3, [(40, 4), (27, 3), (2, 4)], {"arch": "gpt_oss"}, "pass_q"),  # sinks, sliding layers (window 32)
        (4, [(56, 3), (31, 3), (17, 3)], {"arch": "mistral", "sliding_window": 24}, "pass_kv"),
        (4, [(48, 2), (29, 3), (13, 2)], {"arch": "qwen2", "attention_bias": True, "B": 2}, "pass_q"),
    ],
)
def test_multiturn_chat_matches_single_process(pools, P, turns, over, strategy):
    """prefill, generate, then (extend, generate) for each later turn over one ShardedCache (4-layer Llama,
    GQA 8/2 unless said, float32, odd turn lengths): the same greedy ids as one process generating over the
    whole conversation each turn, logits within 1e-4, shards balanced."""
    over = dict(over)
    arch, B = over.pop("arch", "llama"), over.pop("B", 1)
    res = pools(P).run(hf_cases.multiturn_matches, turns, arch, over, strategy, B)
    r0 = res[0]
    for r in res:
        assert r["tokens"] == r0["want"], (r["tokens"], r0["want"])
    assert r0["logits"] < 1e-4, r0["logits"]
    held = r0["held"]
    assert max(held) - min(held) <= 1, held
    if strategy is not None:
        assert strategy in r0["strategies"], r0["strategies"]


def test_dead_rank_is_named():
    """P=4, rank 2 exits between two layers' pass-Q calls: every other rank names it within the timeout + 2 s
    (the other schedules wait through the same Comm)."""
    timeout = 1.5
    results = spawn(cases.extend_silent_case, 4, "pass_q", 2, timeout, timeout=60)
    for rank in (0, 1, 3):
        elapsed, msg = results[rank]
        assert elapsed < timeout + 2, (rank, elapsed, msg)
        assert "Rank 2 is the one that stopped" in msg, (rank, msg)


def test_extend_refusals(pools):
    for msgs in pools(3).run(hf_cases.extend_refusals):
        assert "differ from the ones this cache was filled with" in msgs["edited"], msgs
        assert "already holds" in msgs["nothing"], msgs
        assert "different conversation" in msgs["ranks"], msgs
        assert "batch of 1" in msgs["batch"], msgs
        assert "divisible by P=3" in msgs["ulysses"], msgs
        assert msgs["held"] == 24 + 5
