"""Cost model: topologies, kernel model, simulator (hand-computable cases) and strategy="auto"."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tokenring
from tokenring.layouts import default_layout
from tokenring.schedules import Compute, Shapes, message_bytes
from tokenring.sim import auto as auto_mod
from tokenring.sim.kernel_model import KernelModel, h200_table, kernel_model
from tokenring.sim.simulator import CompiledSchedule, compile_schedule, shapes_for, simulate, simulate_pass
from tokenring.sim.topology import (
    PRESETS,
    ClusterTopology,
    GraphTopology,
    MeshTopology,
    RingTopology,
    SwitchTopology,
    get_topology,
    parse_rate,
    parse_time,
)
from tokenring.strategies import get as get_strategy

INF = float("inf")


def flat_kernel(t_block=0.0, merge=0.0) -> KernelModel:
    """Every block takes t_block seconds (peak infinite), merges/adds take ``merge``."""
    return KernelModel(
        "flat",
        (t_block, INF),
        (t_block, INF),
        (t_block, INF),
        (t_block, INF),
        mem_bw=INF,
        merge=(merge, 0.0),
        add=(merge, 0.0),
        step=0.0,
    )


# ---------------------------------------------------------------- topology


def test_parse_units():
    assert parse_rate("200mbit") == pytest.approx(25e6)
    assert parse_rate("25MB/s") == pytest.approx(25e6)
    assert parse_rate("1.4GB/s") == pytest.approx(1.4e9)
    assert parse_rate("400Gbit") == pytest.approx(50e9)
    assert parse_rate(7.0) == 7.0
    assert parse_time("5us") == pytest.approx(5e-6) and parse_time("0.2ms") == pytest.approx(2e-4)
    with pytest.raises(ValueError):
        parse_rate("fast")


@pytest.mark.parametrize(
    "topo",
    [
        MeshTopology("m", 2, link_bw=1e6, latency=1e-3),
        SwitchTopology("s", 2, port_bw=1e6, latency=1e-3),
        RingTopology("r", 2, link_bw=1e6, latency=1e-3),
        GraphTopology("g", 2, links=[(0, 1, 1e6, 1e-3), (1, 0, 1e6, 1e-3)]),
    ],
)
def test_one_link_one_message(topo):
    assert topo.flow_times([0], [1], [2e6]) == pytest.approx([1e-3 + 2.0])


def test_shared_port_vs_dedicated_links():
    sw = SwitchTopology("s", 3, port_bw=1e6, latency=0)
    mesh = MeshTopology("m", 3, link_bw=1e6, latency=0)
    # rank 0 sends 1 MB to each of 1 and 2: one egress port vs two links
    assert sw.flow_times([0, 0], [1, 2], [1e6, 1e6]) == pytest.approx([2.0, 2.0])
    assert mesh.flow_times([0, 0], [1, 2], [1e6, 1e6]) == pytest.approx([1.0, 1.0])
    # both directions of a full-duplex port / link do not contend
    assert sw.flow_times([0, 1], [1, 0], [1e6, 1e6]) == pytest.approx([1.0, 1.0])
    # two senders into one receiver share its ingress
    assert sw.flow_times([1, 2], [0, 0], [1e6, 1e6]) == pytest.approx([2.0, 2.0])


def test_per_flow_cap_and_uplink():
    t = SwitchTopology("pcie", 4, flow_bw=1e6, port_bw=3e6, latency=0, group=2, uplink_bw=1.5e6)
    assert t.flow_times([0], [1], [1e6]) == pytest.approx([1.0])  # one stream: capped at 1 MB/s
    assert t.flow_times([0, 0], [1, 3], [1e6, 1e6]) == pytest.approx([1.0, 1.0])
    # 0->2 and 1->3 cross the group uplink together: 2 MB over 1.5 MB/s
    assert t.flow_times([0, 1], [2, 3], [1e6, 1e6]) == pytest.approx([2 / 1.5, 2 / 1.5])


def test_ring_routes_match_graph():
    P = 7
    ring = RingTopology("r", P, link_bw=1e6, latency=1e-4)
    links = []
    for r in range(P):
        links += [(r, (r + 1) % P, 1e6, 1e-4), ((r + 1) % P, r, 1e6, 1e-4)]
    graph = GraphTopology("g", P, links=links)
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        src = rng.integers(0, P, n)
        dst = (src + rng.integers(1, P, n)) % P
        b = rng.uniform(1e5, 1e6, n)
        assert ring.flow_times(src, dst, b) == pytest.approx(graph.flow_times(src, dst, b))


def test_cluster_uses_nics_between_nodes():
    node = SwitchTopology("n", 2, port_bw=10e6, latency=0)
    c = ClusterTopology("c", 4, node=node, nic_bw=1e6, nic_latency=0.5)
    assert c.flow_times([0], [1], [1e6]) == pytest.approx([0.1])  # inside node 0
    assert c.flow_times([2], [3], [1e6]) == pytest.approx([0.1])  # inside node 1
    assert c.flow_times([0], [2], [1e6]) == pytest.approx([1.5])  # NIC of 0 -> NIC of 2
    assert c.flow_times([0, 0], [2, 3], [1e6, 1e6]) == pytest.approx([2.5, 2.5])  # sender's NIC shared


@pytest.mark.parametrize("name", [n for n in PRESETS])
def test_presets_load_and_scale(name):
    t = get_topology(name)
    assert t.source
    big = t.with_P(1024)
    src = np.arange(1024)
    times = big.flow_times(src, (src + 1) % 1024, np.full(1024, 1e6))
    assert np.all(np.isfinite(times)) and np.all(times > 0)


def test_user_topology_files(tmp_path, monkeypatch):
    spec = {
        "kind": "graph",
        "P": 3,
        "links": [[0, "sw", "1MB/s", "1ms"], [1, "sw", "1MB/s", "1ms"], [2, "sw", "1MB/s", "1ms"]],
    }
    p = tmp_path / "box.json"
    p.write_text(json.dumps(spec))
    t = get_topology(str(p))
    assert t.flow_times([0], [1], [1e6]) == pytest.approx([1.002])
    y = tmp_path / "m.yaml"
    y.write_text("kind: mesh\nP: 4\nlink_bw: 2MB/s\nlatency: 0\n")
    assert get_topology(str(y)).flow_times([0], [3], [2e6]) == pytest.approx([1.0])
    t = get_topology(str(y))
    assert (t.queued, t.fair_share, t.ready_notice) == (True, False, False)
    y.write_text("kind: switch\nP: 4\nport_bw: 2MB/s\nfair_share: true\nready_notice: true\nqueued: true\n")
    t = get_topology(str(y))
    assert (t.queued, t.fair_share, t.ready_notice) == (True, True, True)
    assert get_topology("mesh:100mbit", 4).describe().startswith("mesh:100mbit")
    monkeypatch.setenv("TOKENRING_TOPOLOGY", str(p))
    assert auto_mod.get_current_topology(3)[0].name == "graph"


# ---------------------------------------------------------------- kernel model


# cuDNN's MHA and GQA rows at 2048 causal differ by 21%; the model averages rows of one size.
@pytest.mark.parametrize("backend,rel", [("flash", 0.05), ("cudnn", 0.11)])
def test_h200_model_reproduces_table(backend, rel):
    m = kernel_model("h200", backend=backend)
    for r in h200_table()["rows"]:
        t = m.block_time(r["n"], r["n"], r["hq"], r["hkv"], r["d"], r["causal"], False) * 1e3
        assert t == pytest.approx(r[f"{backend}_fwd_ms"], rel=rel)
    # beyond the table: linear in FLOPs
    a = m.block_time(65536, 65536, 32, 32, 128, False, False)
    b = m.block_time(131072, 65536, 32, 32, 128, False, False)
    assert b / a == pytest.approx(2.0, rel=0.02)


def test_devices_differ_sensibly():
    h, a = kernel_model("h100"), kernel_model("a10")
    assert a.block_time(6000, 6000, 32, 32, 128, False, False) > 3 * h.block_time(6000, 6000, 32, 32, 128, False, False)


# ---------------------------------------------------------------- simulator: hand-computable cases


def _hand(
    steps,
    comp_classes=((True, Compute(0, 0, "all", 0, "all")),),
    msg_classes=(("q", "all", "all"),),
    P=2,
    backward=False,
):
    """A hand-written compiled schedule; its computes are costed as row blocks (token_ring's ``block_dims``)."""
    arr = lambda x: np.array(x, dtype=np.int64)
    return CompiledSchedule(
        "token_ring",
        P,
        "contiguous",
        False,
        backward,
        list(comp_classes),
        list(msg_classes),
        [tuple(arr(x) for x in st) for st in steps],
    )


SH = Shapes(1, 1000, 1, 1, 250, torch.float32, 2)  # a "q" message of 1000*250*4 = 1 MB


def test_one_message_only():
    cs = _hand([([], [], [0], [1], [0])])
    topo = MeshTopology("m", 2, link_bw=1e6, latency=1e-3)
    r = simulate_pass(cs, SH, topo, flat_kernel())
    assert r.time == pytest.approx(1.001)
    assert r.exposed_comm == pytest.approx(1.001) and r.steps[0].bound == "comm"


def test_pure_compute():
    cs = _hand([([0, 0, 1], [0, 0, 0], [], [], [])])
    r = simulate_pass(cs, SH, MeshTopology("m", 2, link_bw=1e6), flat_kernel(0.25))
    assert r.time == pytest.approx(0.5) and r.exposed_comm == 0 and r.regime == "compute-bound"


@pytest.mark.parametrize("t_block, expect, exposed", [(2.0, 2.0, 0.0), (0.5, 1.0, 0.5)])
def test_perfect_overlap(t_block, expect, exposed):
    cs = _hand([([0, 1], [0, 0], [0, 1], [1, 0], [0, 0])])
    r = simulate_pass(cs, SH, MeshTopology("m", 2, link_bw=1e6, latency=0), flat_kernel(t_block))
    assert r.time == pytest.approx(expect) and r.exposed_comm == pytest.approx(exposed)


def test_message_waits_for_both_ends_to_post():
    # step 0: rank 0 computes 1 s; step 1: 0 -> 1, 1 s on the wire: rank 1 posts at 0 but 0 only at 1
    cs = _hand([([0], [0], [], [], []), ([], [], [0], [1], [0])])
    r = simulate_pass(cs, SH, MeshTopology("m", 2, link_bw=1e6, latency=0), flat_kernel(1.0))
    assert r.time == pytest.approx(2.0)


@pytest.mark.parametrize("notice", [False, True])
@pytest.mark.parametrize("ready", [0, 1])
def test_ready_notice_queues_behind_reverse_traffic(notice, ready):
    """Step 0: rank 1 sends 0 a message due at step 1 (1 s on link 1->0). Step 1: rank 0 sends 1 a message
    whose receive rank 1 posts at step ``ready``. Where the transport waits for the receiver's ready notice
    (gloo over TCP) and rank 1 posts at step 1, the notice crosses link 1->0 behind the first message, so the
    second starts at 1 s; posted at step 0 (before the first message), or without notices, it starts at 0."""
    cs = _hand([([], [], [1], [0], [0], [1], [0]), ([], [], [0], [1], [0], [1], [ready])])
    topo = MeshTopology("m", 2, link_bw=1e6, latency=0, ready_notice=notice)
    r = simulate_pass(cs, SH, topo, flat_kernel(), queued=True)
    assert r.time == pytest.approx(2.0 if notice and ready == 1 else 1.0)
    assert simulate_pass(cs, SH, topo, flat_kernel(), queued=False).time == pytest.approx(1.0)  # plain: no queues


@pytest.mark.parametrize("fair", [False, True])
def test_fair_share_between_connections(fair):
    """Rank 0's switch port (1 MB/s): step 0 posts 1 MB from rank 1, due at step 1; step 1 posts 0.5 MB from
    rank 2. FIFO (the default): the second waits for the first, done at 1.5 s. Fair sharing (TCP, the testbeds):
    they share the port at once and the second is done at 1.0 s, as is the first in the model."""
    cs = _hand(
        [([], [], [1], [0], [0], [1]), ([], [], [2], [0], [1], [1])],
        P=3,
        msg_classes=(("q", "all", "all"), ("q", "lo", "all")),
    )
    topo = SwitchTopology("s", 3, port_bw=1e6, latency=0, fair_share=fair)
    sh = Shapes(1, 1000, 1, 1, 250, torch.float32, 3)
    assert simulate_pass(cs, sh, topo, flat_kernel(), queued=True).time == pytest.approx(1.0 if fair else 1.5)
    assert simulate_pass(cs, sh, topo, flat_kernel(), queued=False).time == pytest.approx(1.0)


def test_receive_handling_after_wait():
    cs = _hand([([], [], [0], [1], [0])], msg_classes=(("out", "all", "all"),))
    sh = Shapes(1, 1000, 1, 1, 250, torch.float32, 2)
    nbytes = message_bytes(tokenring.schedules.Message(0, 1, "out", 0), sh)
    r = simulate_pass(cs, sh, MeshTopology("m", 2, link_bw=1e6, latency=0), flat_kernel(0.0, merge=0.3))
    assert r.time == pytest.approx(nbytes / 1e6 + 0.3)


@pytest.mark.parametrize(
    "name",
    [
        "token_ring:relay",
        "token_ring:direct,c=2,k=2",
        "ring",
        "ring:direct,c=3,k=1",
        "ulysses",
        "ring_bidir",
        "usp:n=2",
        "double_ring:n=2",
        "token_ring_2d:direct,c=2,k=1,n=2",
    ],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_compiled_schedule_is_the_executors(name, causal, backward):
    P, layout = 4, default_layout(causal)
    st = get_strategy(name)
    sched = (st.backward_schedule if backward else st.forward_schedule)(P, layout, causal)
    cs = compile_schedule(name, P, layout, causal, backward)
    assert len(cs.steps) == len(sched.steps)
    for t, (step, (cr, ck, ms, md, mk, du, rd)) in enumerate(zip(sched.steps, cs.steps)):
        assert list(cr) == [c.rank for c in step.computes]
        assert [
            (m.src, m.dst, m.kind, m.part, m.heads, max(m.due, t), t if m.ready < 0 else min(m.ready, t))
            for m in step.messages
        ] == [(int(s), int(d), *cs.msg_classes[k], int(u), int(r)) for s, d, k, u, r in zip(ms, md, mk, du, rd)]
    # bytes a rank sends in the simulation = the schedule's message bytes
    sh = Shapes(1, 64, 8, 2, 16, torch.float32, P)
    r = simulate(name, sh, MeshTopology("m", P, link_bw=1e9), flat_kernel(), causal=causal, backward=backward)
    sent = [0] * P
    for step in sched.steps:
        for m in step.messages:
            sent[m.src] += message_bytes(m, sh, st.payload)
    assert r.passes[-1].bytes_per_rank == max(sent)


def test_ring_pure_compute_sums_blocks():
    P = 4
    sh = shapes_for(4096, P, 8, 8, 64, dtype=torch.float32)
    r = simulate("ring", sh, MeshTopology("m", P, link_bw=INF, latency=0), flat_kernel(0.01), causal=False)
    assert r.time == pytest.approx(P * 0.01)  # P blocks, merges free, links infinitely fast


def test_paper_effect_mesh_vs_switch():
    """Comm-bound MHA: token_ring's Q and partials use different mesh links (P=8: 9 one-way loads vs ring's
    7 double ones), tie on a switch; GQA favours ring."""
    P, km = 8, flat_kernel(0.0)
    sh = shapes_for(4096 * P, P, 32, 32, 128)
    mesh, sw = get_topology("mesh:200mbit", P), get_topology("switch:200mbit", P)
    t = lambda n, topo, s=sh: simulate(n, s, topo, km).time
    assert t("token_ring:relay", mesh) < 0.7 * t("ring", mesh)
    assert t("token_ring:relay", sw) == pytest.approx(t("ring", sw), rel=0.2)
    gqa = shapes_for(4096 * P, P, 32, 8, 128)
    assert t("ring", sw, gqa) < 0.5 * t("token_ring:relay", sw, gqa)
    # the direct variant uses every mesh link: its comm-bound time is far below the relay's
    assert t("token_ring:direct,c=2,k=7", mesh) < 0.6 * t("token_ring:relay", mesh)


def test_paper_a10_per_step_comm():
    """4xA10 PCIe, S=24000, H=32, d=128 forward: per-step transfer ~7.6 ms (ring), 3.5-4.6 ms (token_ring)."""
    topo = get_topology("a10-pcie-4")
    sh = shapes_for(24000, 4, 32, 32, 128)
    ring = simulate("ring", sh, topo).passes[0].steps
    tr = simulate("token_ring:relay", sh, topo).passes[0].steps
    assert all(abs(s.comm - 7.6e-3) < 0.25 * 7.6e-3 for s in ring[:3])
    assert all(3.5e-3 * 0.75 < s.comm < 4.6e-3 * 1.25 for s in tr[1:4])


def test_large_P_is_fast():
    import time

    t0 = time.perf_counter()
    sh = shapes_for(131072, 128, 32, 8)
    r = simulate("token_ring", sh, get_topology("ib-2x8", 128), causal=True, backward=True)
    assert r.time > 0 and time.perf_counter() - t0 < 20


# ---------------------------------------------------------------- auto


def test_auto_never_picks_ulysses_when_heads_do_not_divide():
    for P in (3, 5, 6):
        for topo in ("mesh:200mbit", "switch:1gbit", "h100-nvswitch-8"):
            name = tokenring.choose_strategy(4, 2, P, s=64, d=16, dtype=torch.float32, causal=True, topology=topo)
            assert name.split(":")[0] in ("token_ring", "ring")


def test_auto_follows_the_model_and_explains(capsys):
    q, k_mha, k_gqa = (1, 4096, 32, 128), (1, 4096, 32, 128), (1, 4096, 4, 128)
    # comm-bound MHA on a mesh: token_ring; GQA on a switch: ring (ulysses excluded: 32 % 6 != 0)
    kw = dict(d=128, dtype=torch.bfloat16, backward=False)
    mesh = {"kind": "mesh", "link_bw": "1GB/s", "device": "h100"}
    switch = {"kind": "switch", "port_bw": "1GB/s", "device": "h100"}
    assert tokenring.choose_strategy(32, 32, 6, s=4096, topology=mesh, **kw).startswith("token_ring")
    assert tokenring.choose_strategy(32, 4, 6, s=4096, topology=switch, **kw).startswith("ring")
    text = tokenring.explain(q, k_mha, P=4, topology="mesh:100mbit", backward=False)
    out = capsys.readouterr().out
    assert text == out and "token_ring" in text and "ring" in text and "ulysses" in text and "->" in text
    text = tokenring.explain(q, k_gqa, P=3, topology="mesh:100mbit", file=None)
    assert "not a candidate" in text and text.count("ring") >= 3


def test_auto_considers_hierarchical_strategies_on_clusters():
    """On four nodes of 8 GPUs, causal GQA 32/8 at 4K tokens per rank: a hierarchical
    strategy is predicted fastest and auto picks it; on one node there is no node size to try; an explicit
    inner_size makes them candidates anywhere."""
    from tokenring.sim.auto import node_sizes
    from tokenring.strategies import get as get_st

    kw = dict(s=4096, d=128, dtype=torch.bfloat16, causal=True)
    name = tokenring.choose_strategy(32, 8, 32, topology="ib-2x8", **kw)
    assert get_st(name).hierarchical and get_st(name).inner in (2, 4, 8), name
    assert node_sizes(get_topology("ib-2x8", 16), 16) == (2, 4, 8)
    assert node_sizes(get_topology("mesh:200mbit", 4), 4) == ()
    assert node_sizes(get_topology("mesh:200mbit", 4), 4, inner=2) == (2,)
    assert node_sizes(get_topology("ib-2x8", 16), 16, inner=3) == (2, 4, 8)  # 3 does not divide 16
    mixed = tokenring.choose_strategy(
        32, 32, 4, s=4096, d=64, dtype=torch.float32, topology="mesh:200mbit", inner_size=2, requested="token_ring_2d"
    )
    assert mixed.startswith("token_ring_2d:") and get_st(mixed).inner == 2, mixed


def test_two_level_testbed_topology():
    t = get_topology("cluster:2:400mbit:100mbit", 6)
    assert (t.P, t.node.P, t.nics_per_node) == (6, 2, 1)
    assert t.flow_times([0], [1], [1e6]) < t.flow_times([0], [2], [1e6])  # the NIC is the slower link
    assert t.with_P(8).P == 8 and "cluster" in t.describe()
    with pytest.raises(ValueError, match="NODE:INTRA:INTER"):
        get_topology("cluster:400mbit", 4)


def test_set_topology_and_default(monkeypatch):
    monkeypatch.delenv("TOKENRING_TOPOLOGY", raising=False)
    assert auto_mod.get_current_topology(4)[0].name == "loopback"
    tokenring.set_topology("mesh:50mbit")
    try:
        assert auto_mod.get_current_topology(4)[0].name == "mesh:50mbit"
    finally:
        tokenring.set_topology(None)
    with pytest.raises(ValueError):
        tokenring.set_topology("no-such-box")
    # without a local length, the shape-free rule
    assert tokenring.choose_strategy(8, 8, 4) == "token_ring:relay" and tokenring.choose_strategy(8, 2, 4) == "ring"


def test_cpu_calibration_small():
    from tokenring.sim.kernel_model import calibrate_cpu

    m = calibrate_cpu(1, torch.float64, blocks=((32, 2), (64, 2)), d=16, repeats=1)
    t_small = m.block_time(32, 32, 2, 2, 16, False, False)
    t_big = m.block_time(256, 256, 2, 2, 16, False, False)
    assert 0 < t_small < t_big and m.merge_time(1000) > 0


@pytest.mark.parametrize("topo", ["switch:100mbit", "mesh:100mbit", "ring:100mbit"])
def test_queued_variant_only_adds_waits(topo):
    """simulate's default, queued model (messages also wait for resources busy with earlier steps' messages;
    on the testbeds, ``fair_share``, they share them with other connections' instead) is never faster than the
    plain one (``queued=False``), equals it for schedules whose messages all finish
    in their own step (the classic ring on a switch: every message is due in the step that posts it), and
    does not queue behind the host's shared backplane (the testbed topologies have one). The testbeds' ready
    notices (``ready_notice``, on by default there) only add to that."""
    from dataclasses import replace

    import torch

    from tokenring.schedules import Shapes
    from tokenring.sim import get_topology

    sh = Shapes(1, 1024, 8, 8, 64, torch.float32, 4)
    with_notice = get_topology(topo, 4)
    assert with_notice.ready_notice
    t = replace(with_notice, ready_notice=False)
    for name in (
        "token_ring:relay",
        "token_ring:direct,c=2,k=1",
        "token_ring:direct,c=4,k=2",
        "ring",
        "ring:direct,c=1,k=3",
        "ulysses",
    ):
        for causal in (False, True):
            a = simulate(name, sh, t, flat_kernel(1e-3), causal=causal, backward=True, queued=False).time
            b = simulate(name, sh, t, flat_kernel(1e-3), causal=causal, backward=True).time
            c = simulate(name, sh, with_notice, flat_kernel(1e-3), causal=causal, backward=True).time
            assert c >= b * (1 - 1e-12) and b >= a * (1 - 1e-12), (name, causal, a, b, c)
            if name == "ring" and topo.startswith("switch"):
                assert b == pytest.approx(a), (name, causal, a, b)
            if name == "token_ring:direct,c=4,k=2" and topo.startswith("switch"):
                assert b > 1.2 * a, (name, causal, a, b)  # its prefetches share the port with later steps'
            if topo.startswith("mesh"):  # a link per pair: queueing happens only on the backplane, exempt
                assert b == pytest.approx(a), (name, causal, a, b)


def test_auto_keeps_its_choice_across_masks_of_one_class(monkeypatch):
    """Packed training brings new documents every step: ``auto`` decides once per mask class (window, number of
    documents to a power of two), not once per mask, and its cache stays bounded."""
    from tokenring.masks import make_mask

    auto = auto_mod
    monkeypatch.setattr(auto, "_cache", {})
    sh = Shapes(1, 64, 4, 2, 16, torch.float32, 4)
    first = auto.choose(sh, True, "zigzag", mask=make_mask(256, [0, 10, 90, 200, 256], None, True))
    again = auto.choose(sh, True, "zigzag", mask=make_mask(256, [0, 50, 60, 170, 256], None, True))
    assert again is first and len(auto._cache) == 1
    auto.choose(sh, True, "zigzag", mask=make_mask(256, [0, 50, 256], None, True))  # 2 documents: another class
    assert len(auto._cache) == 2
    monkeypatch.setattr(auto, "_CACHE_SIZE", 2)
    auto.choose(sh, True, "zigzag", mask=make_mask(256, [0, 50, 256], (8, -1), True))  # a window: another one
    assert len(auto._cache) == 2
