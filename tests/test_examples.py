"""The examples in examples/, at small sizes, on P=4 gloo ranks (the torchrun one: 2 processes of its own):
each checks itself against one process."""

import ast
import os
import subprocess
import sys
import time

import pytest
from example_cases import run_example


@pytest.mark.parametrize("strategy", ["token_ring", "ring", "ulysses"])
def test_dit_block_non_causal(pools, strategy):
    r = pools(4).run(run_example, "dit_block", "run", 512, 128, strategy)[0]
    assert max(r["attn"], r["out"], r["dx"], r["grad"]) < 1e-4, r


def test_finetune_step(pools):
    pytest.importorskip("transformers")
    r = pools(4).run(run_example, "finetune_long_context", "train", 1024, 2, "auto")[0]
    assert r["grad_rel"] < 1e-4, r
    assert max(abs(a - b) for a, b in zip(r["loss"], r["ref_loss"])) < 1e-5, r
    assert r["param_diff"] < 1e-3, r


def _torchrun(tmp_path, script: str, args: list[str], n: int, timeout: float = 120) -> list[str]:
    """``script`` as torchrun would start it: ``n`` processes on gloo, a file:// rendezvous; their outputs."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", script)
    cmd = [sys.executable, path, "--init-method", f"file://{tmp_path / 'rendezvous'}", "--backend", "gloo", *args]
    procs = []
    for rank in range(n):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(n),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * n, outs
    return outs


@pytest.mark.parametrize("stack", ["trainer", "fsdp2"])
def test_train_dp_cp_example(tmp_path, stack):
    """examples/train_dp_cp.py on 4 processes, dp=2 x cp=2: its first-step loss equals one process's."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    outs = _torchrun(tmp_path, "train_dp_cp.py", ["--dp", "2", "--stack", stack, "--seq", "64", "--steps", "2"], 4)
    check = [line for line in outs[0].splitlines() if line.startswith("check vs one process")]
    assert len(check) == 1 and check[0].endswith(": OK"), outs[0]


def test_torchrun_example_cpu(tmp_path):
    """examples/torchrun_attention.py as torchrun would start it, 2 processes on gloo, file:// rendezvous."""
    outs = _torchrun(
        tmp_path,
        "torchrun_attention.py",
        [
            "--seq",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--causal",
            "--dtype",
            "float32",
            "--iters",
            "2",
        ],
        2,
    )
    check = [line for line in outs[0].splitlines() if line.startswith("check vs float64 SDPA")]
    assert len(check) == 1 and check[0].endswith(": OK"), outs[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe(tmp_path, path: str, n: int) -> list:
    """examples/recipes/``path`` in ``n`` processes as torchrun starts them (``n`` = 1: plain python): what each
    rank printed on its ``losses`` or ``tokens`` line."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "recipes", path)
    port = str(_free_port())
    procs = []
    for rank in range(n):
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        if n > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        run_dir = tmp_path / f"{n}-{rank}"
        run_dir.mkdir()
        procs.append(
            subprocess.Popen(
                [sys.executable, script],
                env=env,
                cwd=run_dir,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [0] * n, "\n".join(
        f"--- rank {r} exited {c}:\n{o[-4000:]}" for r, (c, o) in enumerate(zip(codes, outs))
    )
    printed = [
        [x.split(" ", 1)[1] for x in out.splitlines() if x.startswith(("losses ", "tokens ", "metrics "))]
        for out in outs
    ]
    assert all(len(p) == 1 for p in printed), outs
    return [ast.literal_eval(p[0]) for p in printed]


RECIPES = ["trainer.py", "trl_sft.py", "trl_grpo.py", "plain_loop.py", "generate.py"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_equals_its_stock_script(tmp_path, name):
    """Each recipe of the README's "Training" and "Generation" sections: the stock script in one process and the
    sequence-parallel one on 2 processes (every rank sharing each sample) log the same losses (GRPO: grad norms and
    rewards) over 2 steps (1e-4 relative), or generate the same sampled tokens on every rank."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    if name.startswith("trl"):
        pytest.importorskip("trl")
    want = _recipe(tmp_path, f"stock/{name}", 1)[0]
    ranks = _recipe(tmp_path, name, 2)
    if name == "generate.py":
        assert ranks == [want, want], (ranks, want)
        return
    got = ranks[0]
    steps = 4 if name == "trl_grpo.py" else 2  # (grad norm, reward) per step
    assert len(got) == len(want) == steps and all(abs(g - w) <= 1e-4 * abs(w) for g, w in zip(got, want)), (got, want)
