"""``tokenring bench`` on tiny shapes: outputs validated, JSON written, traces valid. No timing is asserted."""

import json

import pytest

from tokenring.tools import bench
from tokenring.tools.trace import chrome_trace, direction, step_metrics


def test_bench_cli_validates_and_writes_json_and_traces(tmp_path, capsys):
    out, tdir = tmp_path / "res.json", tmp_path / "traces"
    rc = bench.main(
        [
            "-P",
            "2",
            "--seq",
            "32",
            "--heads",
            "2",
            "--head-dim",
            "8",
            "--causal",
            "--pass",
            "both",
            "--warmup",
            "0",
            "--repeats",
            "2",
            "--strategies",
            "token_ring",
            "ring",
            "pytorch_ring",
            "pytorch_cp",
            "--json",
            str(out),
            "--trace-dir",
            str(tdir),
        ]
    )
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())["cases"][0]
    by = {r["strategy"]: r for r in res["results"]}
    for name in ("token_ring", "ring", "pytorch_ring"):
        r = by[name]
        assert r["check"]["ok"], r["check"]
        assert set(r["check"]["errors"]) == {"out", "dq", "dk", "dv"}
        assert len(r["times"]) == 2 and r["time_min"] <= r["time"] <= r["time_max"]
        assert "vs_best" in r
    assert "skipped" in by["pytorch_cp"]  # causal / backward: not supported by the public API on CPU
    for name in ("token_ring", "ring"):
        r = by[name]
        assert set(r["phases"]) == {"fwd", "bwd"}
        assert r["bytes"]["busiest_link"] > 0 and len(r["bytes"]["per_rank"]) == 2
        assert r["comm_only_time"] > 0
    # traffic split: ring sends only data (K/V) forward and dK/dV backward; token_ring returns partials
    assert by["token_ring"]["bytes"]["per_rank"][0]["results"] > 0
    trace = json.loads((tdir / "token_ring.trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert (tdir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "token_ring" in printed and "all outputs match" in printed


def test_bench_forward_gqa_with_pytorch_public_api(tmp_path):
    out = tmp_path / "r.json"
    rc = bench.main(
        [
            "-P",
            "2",
            "--seq",
            "32",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--no-comm-only",
            "--no-trace",
            "--strategies",
            "token_ring",
            "ulysses",
            "pytorch_cp",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    by = {r["strategy"]: r for r in json.loads(out.read_text())["cases"][0]["results"]}
    for name in ("token_ring", "ulysses", "pytorch_cp"):
        assert by[name]["check"]["ok"], by[name]


def test_failing_rank_is_reported():
    spec = bench.make_spec(P=2, S=16, H=2, d=8, strategies=["ring"], repeats=1, warmup=0, fail_rank=1, timeout=30)
    with pytest.raises(RuntimeError, match="rank 1"):
        bench.run(spec)


def _ev(lane, start, end, step, kind=None, **kw):
    e = dict(lane=lane, name=kind or "c", start=start, end=end, rank=0, step=step, **kw)
    if kind:
        e.update(kind=kind, peer=1, bytes=100)
    return e


def test_step_metrics_and_chrome_trace_on_synthetic_events():
    r0 = [
        _ev("compute", 0.0, 1.0, 0),
        _ev("send", 0.0, 3.0, 0, "kv"),
        _ev("recv", 0.0, 3.0, 0, "kv"),
        _ev("compute", 3.0, 5.0, 1),
    ]
    r1 = [_ev("compute", 0.5, 2.0, 0), _ev("send", 0.5, 2.5, 1, "out")]
    m = step_metrics(r0)
    assert [x["step"] for x in m] == [0, 1]
    assert m[0]["compute"] == 1.0 and m[0]["exposed"] == 2.0 and m[0]["bytes_data"] == 100
    assert m[1]["exposed"] == 0.0 and m[1]["time"] == 2.0
    assert direction("q") == "data" and direction("out") == "results" and direction("dkv") == "results"
    tr = json.loads(json.dumps(chrome_trace([r0, r1])))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert min(e["ts"] for e in xs) == 0.0 and all(e["dur"] >= 0 for e in xs)
    names = {(e["pid"], e["args"]["name"]) for e in tr["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}


def test_gpu_check_runs_on_cpu(tmp_path):
    """bench/gpu_check.py (the one-shot GPU check) on CPU with tiny shapes: every part runs, every correctness
    case passes (exit 0, or 2 = only performance goals missed); with an injected wrong output it exits 1 and
    names the case."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench", "gpu_check.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(out, *extra):
        return subprocess.run(
            [sys.executable, script, "--device", "cpu", "--quick", "--out-dir", str(out), *extra],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )

    p = run(tmp_path / "ok")
    assert p.returncode in (0, 2), p.stdout + p.stderr
    res = json.loads((tmp_path / "ok" / "results.json").read_text())
    assert res["exit_code"] == p.returncode and res["failures"] == []
    cases = res["correctness"]["cases"]
    assert {c["strategy"] for c in cases} == {
        "token_ring",
        "ring",
        "ulysses",
        "ring_bidir",
        "token_ring:relay",
        "token_ring:direct,c=2,k=1",
        "usp:n=2",
        "double_ring:n=2",
        "token_ring_2d:n=2",
    }
    assert {c["dtype"] for c in cases} == {"bfloat16", "float16", "float32"}
    assert all(c["ok"] for c in cases) and res["correctness"]["failed"] == 0, [c for c in cases if not c["ok"]]
    assert set(res["correctness"]["backward_kernels"]) == {"bfloat16", "float16", "float32"}
    assert len(res["kernels"]["rows"]) == 4 and res["merge"]["goal"] in ("PASS", "FAIL")
    assert {s["phase"] for s in res["timeline"]["overlap"]} == {"fwd", "bwd"}
    assert (tmp_path / "ok" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "| P | strategy |" in (tmp_path / "ok" / "results.md").read_text()
    assert (p.returncode == 2) == bool(res["goals_missed"])

    bad = run(tmp_path / "bad", "--inject-error", "--parts", "correctness")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    res = json.loads((tmp_path / "bad" / "results.json").read_text())
    failed = [c["name"] for c in res["correctness"]["cases"] if not c["ok"]]
    assert failed == [res["args"]["inject_error"]], failed
    assert f"FAILED CHECKS (1):\n  - correctness {failed[0]}: out rel err" in bad.stdout, bad.stdout


@pytest.mark.parametrize("interleave", [True, False])
def test_rounds_interleave_strategies_with_rotating_order(interleave):
    """Interleaved: every strategy warms up first, then each round times one call of every strategy, the order
    rotated each round (so a drift of the machine reaches all alike); sequential: one strategy after another."""
    runner = bench._Runner.__new__(bench._Runner)
    runner.spec, runner.rank = dict(repeats=3, interleave=interleave), 1
    order = []
    runner.begin = lambda name: order.append(("warm", name)) or {"name": name}
    runner.timed = lambda st: order.append(("call", st["name"]))
    runner.finish = lambda st: st["name"]
    assert runner.run_all(["a", "b", "c"]) == ["a", "b", "c"]
    calls = [n for what, n in order if what == "call"]
    if interleave:
        assert order[:3] == [("warm", "a"), ("warm", "b"), ("warm", "c")]
        assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    else:
        assert calls == ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
        assert order[0] == ("warm", "a") and order[4] == ("warm", "b")


def test_the_way_down_to_the_kernel_enters_no_module_twice():
    """bench/host_overhead.py's walk of a warm ring call (rank 1 of 4 on the fake group): the call stack when the
    first kernel call begins passes each of tokenring's modules once (issue 58's straight path), from api.py to
    the CPU kernel."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, os.pardir, "bench", "host_overhead.py")
    root = os.path.join(here, os.pardir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "bench")]))
    res = subprocess.run([sys.executable, script, "--walk-child"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    walk = json.loads(res.stdout.strip().splitlines()[-1])
    down = [frame.split(":")[0] for frame in walk["down"]]
    assert down[0] == "api.py" and down[-1] == "kernels/cpu.py", walk["down"]
    assert walk["down_twice"] == [], walk["down"]
