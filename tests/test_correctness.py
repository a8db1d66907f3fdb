"""Every strategy, forward and backward, against a float64 single-process reference.

Grid per (P, strategy): causal x layout x (H, Hkv) in {(4,4), (8,2), (4,1)} x head dim in {16, 64, 72} x
batch in {1, 2} x dtype in {float64, float32, bfloat16}; tolerances (relative to the reference's max):
float64 1e-9, float32 1e-5, bfloat16 2e-2. Ulysses runs where H % P == 0 and ring_bidir where Hkv is even
(their refusals are tested elsewhere).
"""

import itertools

import cases
import pytest

from tokenring.strategies import ALIASES, FAMILIES, HIERARCHICAL, why_not

# Every flat strategy in the registry (hierarchical ones need a node size: tests/test_hierarchical.py), so a
# new one is tested here without editing this file.
FLAT = [f for f in FAMILIES if f not in HIERARCHICAL]

HEADS = [(4, 4), (8, 2), (4, 1)]
# Ulysses needs H % P == 0; these add odd P and K/V-head replication (P > Hkv, P not a multiple of Hkv).
ULYSSES_EXTRA_HEADS = [(6, 6), (6, 2), (12, 4)]
DIMS = [16, 64, 72]
LAYOUTS = [(False, "contiguous"), (False, "zigzag"), (True, "contiguous"), (True, "zigzag")]


def grid(P: int, strategy: str) -> list[dict]:
    out = []
    for i, ((causal, layout), (H, Hkv), d, B, dtype) in enumerate(
        itertools.product(
            LAYOUTS,
            HEADS + (ULYSSES_EXTRA_HEADS if strategy == "ulysses" else []),
            DIMS,
            [1, 2],
            ["float64", "float32", "bfloat16"],
        )
    ):
        if why_not(strategy, H, Hkv, P):  # the refusals are tested elsewhere
            continue
        # Local length: even (zigzag needs two chunks), varied so blocks are not all the same size.
        s = 2 * (2 + i % 3)
        scale = cases.scale_of(d) if i % 4 == 0 else None  # a custom softmax_scale on a quarter of the cases
        out.append(
            dict(
                B=B,
                s=s,
                H=H,
                Hkv=Hkv,
                d=d,
                dtype=dtype,
                causal=causal,
                layout=layout,
                strategy=strategy,
                scale=scale,
                seed=i,
            )
        )
    return out


@pytest.mark.parametrize("strategy", FLAT + list(ALIASES))
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_matches_reference(pools, P, strategy):
    todo = grid(P, strategy)
    assert todo, "empty grid"
    done = pools(P).run(cases.check_many, todo)
    assert done == [len(todo)] * P


@pytest.mark.parametrize("P", [2, 4])
def test_longer_sequences(pools, P):
    """Fewer, longer cases: many rows per block exercise the kernels' chunking and the zigzag halves."""
    todo = [
        dict(B=1, s=96, H=4, Hkv=2, d=32, dtype=dt, causal=c, layout=lay, strategy=st, seed=7)
        for st in FLAT
        for dt in ("float64", "float32")
        for c, lay in LAYOUTS
    ]
    pools(P).run(cases.check_many, todo)


@pytest.mark.parametrize("P", [1, 3])
def test_zero_and_negative_scales(pools, P):
    """softmax_scale 0 (uniform over the visible keys) and negative ones, causal and not, with and without
    packed documents: the fused CPU kernel returns NaN for causal blocks at such scales, so they are folded into
    the queries; exact like any other scale."""
    strategies = (*FLAT, "token_ring:direct,c=2,k=1") if P > 1 else ("auto",)
    todo = [
        dict(B=1, s=6, H=6, Hkv=2, d=12, dtype=dt, causal=c, layout=lay, strategy=st, scale=sc, seed=5, cu_seqlens=cu)
        for st in strategies
        for sc in (0.0, -0.3)
        for dt in ("float64", "float32")
        for c, lay in LAYOUTS
        for cu in (None, [0, 5, 6 * P])
    ]
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


def test_strategy_auto(pools):
    todo = [
        dict(B=1, s=8, H=H, Hkv=Hkv, d=16, dtype="float64", causal=True, layout="zigzag", strategy="auto")
        for H, Hkv in HEADS
    ]
    pools(3).run(cases.check_many, todo)


def test_world_size_5(pools):
    """An odd world size above 4: P=5 ranks, every strategy and mask/layout, GQA and MQA, float64."""
    todo = [
        dict(B=2, s=4, H=H, Hkv=Hkv, d=12, dtype="float64", causal=c, layout=lay, strategy=st, seed=11)
        for st in FLAT
        for c, lay in LAYOUTS
        for H, Hkv in {"ulysses": [(5, 5), (10, 2), (5, 1)], "ring_bidir": [(4, 4), (6, 2)]}.get(
            st, [(4, 4), (6, 2), (3, 1)]
        )
    ]
    pools(5).run(cases.check_many, todo)


@pytest.mark.parametrize("strategy", FLAT)
def test_process_subgroup(pools, strategy):
    """group= a sub-group whose ranks are not the global ones (ranks 1 and 3 of 4): forward and backward."""
    errs = pools(4).run(cases.subgroup_case, strategy)
    assert errs[0] is None and errs[2] is None
    assert errs[1] < 1e-10 and errs[3] < 1e-10, errs


def variant_grid(P: int, dtypes=("float64",)) -> list[dict]:
    """Every direct variant (token_ring and pass-KV, c in {1, 2, 3}, k in 1..P-1) over masks/layouts, MHA, GQA
    and MQA, odd head dims (12 and 13), uneven chunk sizes (local lengths 6 and 10 cut in 2 or 3 chunks)."""
    out, i = [], 0
    names = [f"{fam}:direct,c={c},k={k}" for fam in ("token_ring", "ring") for c in (1, 2, 3) for k in range(1, P)]
    for name in names:
        for (causal, layout), (H, Hkv) in itertools.product(LAYOUTS, HEADS):
            i += 1
            out.append(
                dict(
                    B=1 + i % 2,
                    s=6 if i % 2 else 10,
                    H=H,
                    Hkv=Hkv,
                    d=12 + i % 3 // 2,
                    dtype=dtypes[i % len(dtypes)],
                    causal=causal,
                    layout=layout,
                    strategy=name,
                    seed=i,
                )
            )
    return out


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_direct_variants_match_reference(pools, P):
    todo = variant_grid(P)
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


def test_direct_variants_low_precision(pools):
    todo = variant_grid(3, ("float32", "bfloat16"))
    pools(3).run(cases.check_many, todo)


def test_family_choice_on_a_mesh(pools):
    """strategy="token_ring" / "ring:auto" / "auto" with a mesh topology (the cost model picks a direct
    variant there) stay exact, and every rank runs rank 0's choice."""
    todo = [
        dict(
            B=1,
            s=16,
            H=4,
            Hkv=Hkv,
            d=16,
            dtype="float64",
            causal=c,
            layout=lay,
            strategy=st,
            seed=3,
            topology="mesh:100mbit",
        )
        for st in ("token_ring", "ring:auto", "auto")
        for c, lay in LAYOUTS
        for Hkv in (4, 1)
    ]
    pools(4).run(cases.check_many, todo)


def test_rank0_decides_the_variant(pools):
    """Ranks told different topologies still run one strategy: rank 0's choice (a per-host input such as a
    topology set on one rank only cannot split them)."""
    names = pools(4).run(cases.chosen_strategy, "mesh:100mbit", "token_ring")
    assert len(set(names)) == 1, names
    mixed = pools(4).run(cases.chosen_strategy_mixed, "token_ring")
    assert len(set(mixed)) == 1 and mixed[0] == names[0], (mixed, names)


def sink_grid(P: int) -> list[dict]:
    """Attention sinks (gpt-oss): every flat strategy (hierarchical ones at P=4) over causal/layouts, MHA and
    GQA, with and without documents and windows; mostly float64, some float32/bfloat16."""
    names = (
        [
            "token_ring",
            "token_ring_paper",
            "token_ring:direct,c=2,k=1",
            "ring",
            "ring:direct,c=1,k=1",
            "ring_bidir",
            "ulysses",
        ]
        if P > 1
        else ["auto"]
    )
    if P == 4:
        names += ["usp:n=2", "double_ring:n=2", "token_ring_2d:n=2", "double_ring:n=2,keep"]
    out, i = [], 0
    for name in names:
        for (causal, layout), (H, Hkv), extra in itertools.product(
            LAYOUTS, [(4, 4), (4, 2)], [{}, {"cu_seqlens": [0, 3, 4 * P]}, {"window": (2, 1)}]
        ):
            i += 1
            if (P > 1 and why_not(name, H, Hkv, P)) or (name == "ring_bidir" and Hkv % 2):
                continue
            out.append(
                dict(
                    B=1 + i % 2,
                    s=4,
                    H=H,
                    Hkv=Hkv,
                    d=8 + i % 3,
                    dtype=("float64", "float32", "bfloat16", "float64")[i % 4],
                    causal=causal,
                    layout=layout,
                    strategy=name,
                    seed=i,
                    sinks=True,
                    **extra,
                )
            )
    return out


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_sinks_match_reference(pools, P):
    """out, dq, dk, dv and the sinks' gradient (summed over the ranks) against a float64 softmax with one more
    logit per row."""
    todo = sink_grid(P)
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_value_head_dim_apart(pools, P):
    """MLA (DeepSeek-V3): v's head dim (16, or 40) differs from q/k's (24), every strategy, causal and not,
    GQA, packed documents and windows: out (B, s, H, dv) and every gradient equal float64 attention (1e-9)."""
    strategies = (*FLAT, "token_ring:direct,c=2,k=1") if P > 1 else ("auto",)
    todo = [
        dict(B=1, s=4, H=2 * n, Hkv=n, d=24, dv=dv, dtype="float64", causal=c, layout=lay, strategy=st, seed=7, **extra)
        for st in strategies
        for n in [P if st == "ulysses" else 2]  # ulysses splits the heads
        for dv in (16, 40)
        for c, lay in LAYOUTS
        for extra in ({}, {"cu_seqlens": [0, 3, 4 * P]}, {"window": (3, 0 if c else 2)})[: 3 if dv == 16 else 1]
    ]
    assert pools(P).run(cases.check_many, todo) == [len(todo)] * P


@pytest.mark.parametrize("P,strategy", [(2, "auto"), (3, "auto"), (2, "ulysses"), (3, "token_ring")])
def test_repeated_calls_take_the_prepared_path_exactly(pools, P, strategy):
    """Repeats of a call go straight to its prepared strategy (ops.Ready) where nothing that decides its plan
    changed, and take the full path where something did (requires_grad, check_calls, forget_choices, other
    documents, instruments): every result exact (float64) either way."""
    for r in pools(P).run(cases.repeated_calls_case, strategy):
        # found for calls 2, 3, 5, 6, 9, 11, 14, 15, 17 and the 19th's recompute; the instrumented 15th still runs
        # the full path (its log), and the 18th's documents tensor was edited in place (its version). The third
        # calls (3 and 6) replay their forward straight from the prepared call, and the 3rd its backward too.
        assert r["worst"] < 1e-10 and r["taken"] == 10 and r["replayed"] == 3, r


def replay_grid(P: int, names: list[str], inner_size=None) -> list[dict]:
    """Strategies over masks and layouts, MHA / GQA, an odd head dim, B=2, sinks: the program's replay cases."""
    out = []
    masks = [dict(), dict(cu_seqlens=[0, 3, 5 * P, 8 * P]), dict(window=(3, 0)), dict(sinks=True)]
    for i, (name, (causal, layout), mask) in enumerate(itertools.product(names, LAYOUTS, masks)):
        H, Hkv = HEADS[i % 3]
        if why_not(name, H, Hkv, P, 8, causal and layout == "zigzag") or (mask.get("window") and not causal):
            continue
        case = dict(B=1 + i % 2, s=8, H=H, Hkv=Hkv, d=(8, 13)[i % 2], dtype=("float64", "float32")[i % 2],
                    causal=causal, layout=layout, strategy=name, seed=i, inner_size=inner_size, **mask)  # fmt: skip
        out.append(case)
    return out


@pytest.mark.parametrize(
    "P,names,inner",
    [
        (3, [*FLAT, "token_ring:direct,c=2,k=2", "ring:direct,c=3,k=1"], None),
        (4, ["double_ring:n=2,keep", "token_ring_2d:direct,c=2,k=1,n=2", "usp"], 2),
    ],
)
def test_replay_equals_step_loop(pools, P, names, inner):
    """A schedule's recorded program, replayed (lowered at the first call, cached for the next), gives the step
    loop's bits: forward and backward, every flat strategy, direct variants, two-level ones keeping K/V."""
    todo = replay_grid(P, names, inner)
    assert len(todo) > 20
    assert pools(P).run(cases.replay_case, todo) == [len(todo)] * P
