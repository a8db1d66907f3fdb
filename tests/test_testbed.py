"""The interconnect testbed: setup/teardown leaves nothing behind, even when a rank fails or on SIGTERM.
Needs root and iproute2 (``ip``, ``tc``); skipped, with the reason, otherwise. No timing is asserted."""

import os
import signal
import subprocess
import sys

import pytest

from tokenring.tools import bench, testbed

TB = testbed.Testbed  # not bound as "Testbed": pytest would try to collect it

REASON = testbed.available()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def _host_state():
    """What the testbed must never change outside its namespaces: root-namespace links and qdiscs."""
    links = sorted(line.split(":")[1].strip().split("@")[0] for line in _sh("ip", "-o", "link").splitlines())
    return links, _sh("tc", "qdisc", "show")


def _ours(prefix):
    return [n for n in _sh("ip", "netns", "list").split() if n.startswith(prefix)]


@needs_root
@pytest.mark.parametrize("topology", ["switch", "ring", "mesh"])
def test_setup_and_teardown_leave_nothing(topology):
    before = _host_state()
    prefix = f"trtest-{os.getpid()}-{topology}"
    with TB(3, topology, rate_mbit=100, prefix=prefix) as tb:
        assert len(_ours(prefix)) == 3 + (topology == "switch")
        assert tb.links, "no shaped link"
        for ns, dev in tb.links:
            assert "tbf" in _sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev)
        for r in range(3):  # every peer is routed from the identity address
            for p in range(3):
                if p != r:
                    route = _sh("ip", "-n", tb.ns(r), "route", "get", tb.addr(p))
                    assert f"src {tb.addr(r)}" in route, route
    assert _ours(prefix) == []
    assert _host_state() == before


@needs_root
def test_bench_runs_inside_the_testbed():
    prefix = f"trtest-{os.getpid()}-bench"
    spec = bench.make_spec(
        P=2, S=32, H=2, d=8, strategies=["token_ring", "ring"], repeats=1, warmup=0, comm_only=False, timeout=60
    )
    with TB(2, "mesh", rate_mbit=200, prefix=prefix) as tb:
        res = bench.run(spec, **tb.launch_kwargs())
    assert all(r["check"]["ok"] for r in res["results"])
    assert _ours(prefix) == []


@needs_root
def test_links_do_not_drop():
    """Four ranks pushing several MB at once through one slow NIC link (the two-level testbed at 20 Mbit/s):
    the default queue holds it all (an interconnect is lossless; a drop would cost TCP a 200 ms timeout)."""
    prefix = f"trtest-{os.getpid()}-drop"
    spec = bench.make_spec(
        P=4,
        S=4096,
        H=2,
        Hkv=2,
        d=64,
        strategies=["ring:direct,c=1,k=3"],
        repeats=1,
        warmup=0,
        comm_only=False,
        trace=False,
        timeout=120,
    )
    with TB(4, "cluster", rate_mbit=20, node=2, prefix=prefix) as tb:
        res = bench.run(spec, **tb.launch_kwargs())
        assert tb.dropped() == 0
    assert all(r["check"]["ok"] for r in res["results"])
    assert _ours(prefix) == []


@needs_root
def test_failing_rank_still_tears_down():
    before = _host_state()
    prefix = f"trtest-{os.getpid()}-fail"
    spec = bench.make_spec(P=2, S=16, H=2, d=8, strategies=["ring"], repeats=1, warmup=0, fail_rank=1, timeout=30)
    with pytest.raises(RuntimeError, match="rank 1"):
        with TB(2, "switch", rate_mbit=100, prefix=prefix) as tb:
            bench.run(spec, **tb.launch_kwargs())
    assert _ours(prefix) == []
    assert _host_state() == before


@needs_root
def test_sigterm_tears_down():
    prefix = f"trtest-{os.getpid()}-sig"
    code = (
        f"import time; from tokenring.tools.testbed import Testbed\n"
        f"with Testbed(2, 'ring', 100, prefix={prefix!r}):\n    print('up', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert len(_ours(prefix)) == 2
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert _ours(prefix) == []


@needs_root
def test_cleanup_removes_only_stale_namespaces():
    dead = 9_999_999  # above the largest possible pid_max (2**22): no such process
    stale, live = f"trtb-{dead}-0-r0", f"trtb-{os.getpid()}-99-r0"
    for n in (stale, live):
        subprocess.run(["ip", "netns", "add", n], check=True)
    try:
        removed = testbed.cleanup_stale()
        assert stale in removed and live not in removed
        assert live in _ours("trtb-")
    finally:
        for n in (stale, live):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_refuses_clearly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert testbed.main(["--rate", "100"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="topology"):
        TB(2, "torus", 100)
    with pytest.raises(ValueError, match="rate"):
        TB(2, "mesh", 0)
    with pytest.raises(ValueError, match="node"):
        TB(4, "cluster", 100, node=3)
    with pytest.raises(ValueError, match="node"):
        TB(4, "cluster", 100, node=4)  # one node: nothing between nodes


@needs_root
def test_cluster_testbed_routes_through_one_nic_per_node():
    """Two nodes of two ranks: same-node peers over their own shaped link, other nodes' ranks through the node's
    router (the NIC), whose one link to the switch is shaped both ways; a hierarchical strategy runs exactly
    inside it, with the node size from $LOCAL_WORLD_SIZE as torchrun would set it; nothing is left behind."""
    before = _host_state()
    prefix = f"trtest-{os.getpid()}-cluster"
    spec = bench.make_spec(
        P=4,
        S=32,
        H=2,
        d=8,
        causal=True,
        strategies=["usp", "double_ring"],
        repeats=1,
        warmup=0,
        comm_only=False,
        timeout=60,
    )
    with TB(4, "cluster", rate_mbit=100, node=2, prefix=prefix) as tb:
        assert len(_ours(prefix)) == 4 + 2 + 1  # ranks, routers, switch
        assert tb.spec() == "cluster:2:400mbit:100mbit"
        for r in range(4):
            for p in range(4):
                if p == r:
                    continue
                route = _sh("ip", "-n", tb.ns(r), "route", "get", tb.addr(p))
                assert f"src {tb.addr(r)}" in route
                assert (f"dev p{p}" in route) == (r // 2 == p // 2), route
                assert (tb.router_addr(r // 2) in route) == (r // 2 != p // 2), route
        for a in range(2):
            assert "tbf" in _sh("ip", "netns", "exec", tb.router(a), "tc", "qdisc", "show", "dev", "sw")
        res = bench.run(spec, **tb.launch_kwargs())
    assert [r["variant"] for r in res["results"]] == ["usp:n=2", "double_ring:n=2"]
    assert all(r["check"]["ok"] for r in res["results"])
    assert _ours(prefix) == []
    assert _host_state() == before
