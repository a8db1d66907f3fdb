"""Interconnect models: ranks, directed links with bandwidth and latency, shared vs dedicated paths.
The bottleneck model, the kinds, the options and the presets: docs/sim.md, "Topologies".
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections import deque
from dataclasses import dataclass, field, fields, replace

import numpy as np

from .. import settings
from .kernel_model import model_from_dict

__all__ = [
    "Topology",
    "SwitchTopology",
    "MeshTopology",
    "RingTopology",
    "ClusterTopology",
    "GraphTopology",
    "PRESETS",
    "get_topology",
    "parse_rate",
    "parse_time",
    "topology_from_dict",
    "topology_to_dict",
    "PROFILE_FORMAT",
    "preset_names",
    "detected_topology",
    "gpu_model",
]

INF = float("inf")

_RATE = re.compile(r"^\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)(i?)(bit|b|B|bps|Bps|B/s|b/s)?(/s|ps)?\s*$")


def parse_rate(x) -> float:
    """Bytes per second from a number (bytes/s) or a string such as ``"200mbit"`` or ``"25MB/s"``."""
    if isinstance(x, (int, float)):
        return float(x)
    m = _RATE.match(str(x))
    if not m:
        raise ValueError(f"cannot read {x!r} as a rate; write e.g. '200mbit', '25MB/s' or a number of bytes/s")
    num, prefix, _, unit, _ = m.groups()
    v = float(num) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[prefix.lower()]
    unit = unit or "B"
    if unit.lower().startswith("bit") or unit in ("b", "b/s"):
        v /= 8
    return v


def parse_time(x) -> float:
    """Seconds from a number (seconds) or ``"5us"``, ``"0.2ms"``, ``"1s"``."""
    if isinstance(x, (int, float)):
        return float(x)
    m = re.match(r"^\s*([0-9.eE+-]+)\s*(ns|us|ms|s)?\s*$", str(x))
    if not m:
        raise ValueError(f"cannot read {x!r} as a time; write e.g. '5us', '0.2ms' or a number of seconds")
    return float(m.group(1)) * {None: 1, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


@dataclass
class Topology:
    """Base: ``P`` ranks, a per-flow rate cap, the device whose kernel model goes with it, a citation."""

    name: str
    P: int
    flow_bw: float = INF
    device: str = "cpu"
    source: str = ""
    preset: str = ""  # set on presets: with_P rebuilds from the preset
    # the options below: docs/sim.md, "Topologies"
    cpu_per_byte: float = 0.0
    preset_kw: dict = field(default_factory=dict)
    queued: bool = True  # messages queue behind earlier steps' on links, ports, NICs
    ready_notice: bool = False  # a send waits for the receiver's ready notice (gloo over TCP)
    fair_share: bool = False  # connections share a resource fairly (TCP), else FIFO
    kernel: object = field(default=None, repr=False, compare=False)  # a calibrated kernel model, if any
    measured: dict = field(default=None, repr=False, compare=False)

    # --- what subclasses provide -------------------------------------------------------------------------
    def _routes(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Incidence of flows on resources: ``(flow_index, resource_index)`` pairs."""
        raise NotImplementedError

    def _capacity(self) -> np.ndarray:
        raise NotImplementedError

    def _cap(self, ids: np.ndarray) -> np.ndarray:
        """Capacity (bytes/s) of resources ``ids``."""
        return self._capacity()[ids]

    def _nres(self) -> int:
        return self._capacity().size

    def _latency(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _backplane(self) -> int:
        """Index of the resource capping all traffic together (a CPU host's loopback), or -1."""
        return -1

    def queue_routes(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The resources a message queues on behind earlier steps' messages (not a shared backplane)."""
        fi, ri = self._routes(src, dst)
        bp = self._backplane()
        if bp < 0:
            return fi, ri
        keep = ri != bp
        return fi[keep], ri[keep]

    def with_P(self, P: int) -> "Topology":
        """The same kind of interconnect with ``P`` ranks (presets grow by adding nodes)."""
        if self.preset:
            return _preset(self.preset, P, **self.preset_kw)
        return replace(self, P=P)

    # --- shared ----------------------------------------------------------------------------------------
    def flow_times(self, src, dst, nbytes) -> np.ndarray:
        """Seconds each of these concurrent flows takes (latency + bottleneck share)."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if src.size == 0:
            return np.zeros(0)
        if (src < 0).any() or (src >= self.P).any() or (dst < 0).any() or (dst >= self.P).any():
            raise ValueError(f"topology {self.name!r} has {self.P} ranks; a flow names a rank outside 0..{self.P - 1}")
        fi, ri = self._routes(src, dst)
        worst = np.zeros(src.size)
        if fi.size:
            uniq, inv = np.unique(ri, return_inverse=True)
            load = np.bincount(inv, weights=nbytes[fi], minlength=uniq.size)
            np.maximum.at(worst, fi, (load / self._cap(uniq))[inv])
        worst = np.maximum(worst, nbytes / self.flow_bw)
        return self._latency(src, dst) + worst

    def describe(self) -> str:
        return f"{self.name} ({type(self).__name__[:-8].lower()}, P={self.P})"


@dataclass
class SwitchTopology(Topology):
    """One full-duplex port per rank into a switch (optional sub-switches with uplinks, optional backplane)."""

    port_bw: float = 25e9
    latency: float = 10e-6
    group: int = 0
    uplink_bw: float = INF
    backplane_bw: float = INF

    def _ngroups(self) -> int:
        return -(-self.P // self.group) if self.group else 0

    def _capacity(self) -> np.ndarray:
        g = self._ngroups()
        return np.concatenate([np.full(2 * self.P, self.port_bw), np.full(2 * g, self.uplink_bw), [self.backplane_bw]])

    def _routes(self, src, dst):
        n, P = src.size, self.P
        idx = np.arange(n)
        fis, ris = [idx, idx], [src, P + dst]
        if self.group:
            gs, gd = src // self.group, dst // self.group
            cross = np.nonzero(gs != gd)[0]
            fis += [cross, cross]
            ris += [2 * P + 2 * gs[cross], 2 * P + 2 * gd[cross] + 1]
        if self.backplane_bw < INF:
            fis.append(idx)
            ris.append(np.full(n, 2 * P + 2 * self._ngroups()))
        return np.concatenate(fis), np.concatenate(ris)

    def _latency(self, src, dst):
        return np.full(src.size, self.latency)

    def _backplane(self) -> int:
        return 2 * self.P + 2 * self._ngroups() if self.backplane_bw < INF else -1


@dataclass
class MeshTopology(Topology):
    """A dedicated link per ordered pair, ``link_bw`` per direction (``port_bw``: an optional cap per rank)."""

    link_bw: float = 25e9
    latency: float = 10e-6
    port_bw: float = INF
    backplane_bw: float = INF

    def _capacity(self):
        P = self.P
        return np.concatenate([np.full(P * P, self.link_bw), np.full(2 * P, self.port_bw), [self.backplane_bw]])

    def _nres(self):
        return self.P * self.P + 2 * self.P + 1

    def _cap(self, ids):
        P = self.P
        return np.where(ids < P * P, self.link_bw, np.where(ids < P * P + 2 * P, self.port_bw, self.backplane_bw))

    def _routes(self, src, dst):
        P, n = self.P, src.size
        idx = np.arange(n)
        fis, ris = [idx], [src * P + dst]
        if self.port_bw < INF:
            fis += [idx, idx]
            ris += [P * P + src, P * P + P + dst]
        if self.backplane_bw < INF:
            fis.append(idx)
            ris.append(np.full(n, P * P + 2 * P))
        return np.concatenate(fis), np.concatenate(ris)

    def _latency(self, src, dst):
        return np.full(src.size, self.latency)

    def _backplane(self) -> int:
        return self.P * self.P + 2 * self.P if self.backplane_bw < INF else -1


@dataclass
class RingTopology(Topology):
    """Links only between neighbours (``r <-> r+1``); a flow takes the shorter way and loads every link on it."""

    link_bw: float = 25e9
    latency: float = 10e-6
    backplane_bw: float = INF

    def _ways(self, src, dst):
        P = self.P
        cw = (dst - src) % P
        ccw = (src - dst) % P
        forward = cw <= ccw
        return forward, np.where(forward, cw, ccw)

    def _capacity(self):
        return np.full(2 * self.P, self.link_bw)

    def _latency(self, src, dst):
        return self._ways(src, dst)[1] * self.latency

    def _routes(self, src, dst):
        """Links a flow crosses (clockwise link ``i``: resource ``i``; counter-clockwise: ``P + i``)."""
        P = self.P
        fwd, hops = self._ways(src, dst)
        fi = np.repeat(np.arange(src.size), hops)
        step = np.concatenate([np.arange(h) for h in hops]) if hops.size else np.zeros(0, np.int64)
        s, f = src[fi], fwd[fi]
        ri = np.where(f, (s + step) % P, P + (s - step) % P)
        return fi.astype(np.int64), ri.astype(np.int64)

    def flow_times(self, src, dst, nbytes) -> np.ndarray:
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if src.size == 0:
            return np.zeros(0)
        P = self.P
        fwd, hops = self._ways(src, dst)
        worst = np.zeros(src.size)
        # a clockwise flow from a crosses links a .. a+h-1, a counter-clockwise one ccw links [a-h+1, a]
        for sel, first in ((fwd, src), (~fwd, (src - hops + 1) % P)):
            ids = np.nonzero(sel & (hops > 0))[0]
            if not ids.size:
                continue
            a, h, b = first[ids], hops[ids], nbytes[ids]
            diff = np.zeros(2 * P + 1)
            np.add.at(diff, a, b)
            np.add.at(diff, a + h, -b)
            load2 = np.cumsum(diff)[: 2 * P]
            load = load2[:P] + load2[P:]  # unwrap intervals that pass P - 1 -> 0
            worst[ids] = _range_max(np.concatenate([load, load]), a, a + h) / self.link_bw
        if self.backplane_bw < INF:
            worst = np.maximum(worst, nbytes.sum() / self.backplane_bw)
        worst = np.maximum(worst, nbytes / self.flow_bw)
        return self._latency(src, dst) + worst


def _range_max(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(arr[lo:hi]) for each (lo, hi), hi > lo, via a sparse table (O(n log n) build, O(1) per query)."""
    table = [arr]
    k = 1
    while 2 * k <= arr.size:
        prev = table[-1]
        table.append(np.maximum(prev[:-k], prev[k:]))
        k *= 2
    length = hi - lo
    level = np.floor(np.log2(length)).astype(np.int64)
    out = np.empty(lo.size)
    for lv in np.unique(level):
        sel = level == lv
        t = table[lv]
        out[sel] = np.maximum(t[lo[sel]], t[hi[sel] - (1 << lv)])
    return out


@dataclass
class ClusterTopology(Topology):
    """``P / node.P`` nodes of ``node`` joined through NICs by a non-blocking fabric."""

    node: Topology = None
    nic_bw: float = 50e9
    nic_latency: float = 15e-6
    nics_per_node: int = 0  # 0: one per rank

    def _nn(self) -> int:
        return -(-self.P // self.node.P)

    def _nics(self) -> int:
        return self.nics_per_node or self.node.P

    def _capacity(self):
        node_cap = self.node._capacity()
        return np.concatenate([np.tile(node_cap, self._nn()), np.full(2 * self._nn() * self._nics(), self.nic_bw)])

    def _cap(self, ids):
        n = self.node._nres()
        intra = ids < self._nn() * n
        out = np.full(ids.size, self.nic_bw)
        if intra.any():
            out[intra] = self.node._cap(ids[intra] % n)
        return out

    def _routes(self, src, dst):
        m = self.node.P
        ns, nd = src // m, dst // m
        same = ns == nd
        fis, ris = [], []
        ids = np.nonzero(same)[0]
        if ids.size:
            fi, ri = self.node._routes(src[ids] % m, dst[ids] % m)
            fis.append(ids[fi])
            ris.append(ri + ns[ids][fi] * self.node._nres())
        ids = np.nonzero(~same)[0]
        if ids.size:
            base = self._nn() * self.node._nres()
            k = self._nics()
            fis += [ids, ids]
            ris += [base + 2 * (ns[ids] * k + (src[ids] % m) % k), base + 2 * (nd[ids] * k + (dst[ids] % m) % k) + 1]
        return (np.concatenate(fis) if fis else np.zeros(0, np.int64)), (
            np.concatenate(ris) if ris else np.zeros(0, np.int64)
        )

    def _latency(self, src, dst):
        m = self.node.P
        same = (src // m) == (dst // m)
        out = np.full(src.size, self.nic_latency)
        if same.any():
            out[same] = self.node._latency(src[same] % m, dst[same] % m)
        return out

    def flow_times(self, src, dst, nbytes):
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.float64)
        t = super().flow_times(src, dst, nbytes)
        return np.maximum(t, nbytes / self.node.flow_bw + self._latency(src, dst)) if src.size else t

    def describe(self) -> str:
        return f"{self.name} (cluster of {self._nn()} x {self.node.describe()}, P={self.P})"


@dataclass
class GraphTopology(Topology):
    """User-defined: ``links`` = ``(u, v, bw, latency)`` directed edges; routes are fewest-hop paths."""

    links: list = field(default_factory=list)

    def __post_init__(self):
        adj: dict = {}
        for i, (u, v, bw, lat) in enumerate(self.links):
            adj.setdefault(u, []).append((v, i))
        self._route: dict = {}
        for s in range(self.P):
            prev = {s: None}
            q = deque([s])
            while q:
                u = q.popleft()
                for v, e in adj.get(u, []):
                    if v not in prev:
                        prev[v] = (u, e)
                        q.append(v)
            for d in range(self.P):
                if d == s:
                    continue
                if d not in prev:
                    raise ValueError(f"topology {self.name!r}: no path from rank {s} to rank {d}")
                path, x = [], d
                while prev[x] is not None:
                    u, e = prev[x]
                    path.append(e)
                    x = u
                self._route[(s, d)] = path[::-1]

    def with_P(self, P):
        if P != self.P:
            raise ValueError(f"topology {self.name!r} is defined for exactly {self.P} ranks, not {P}")
        return self

    def _capacity(self):
        return np.array([float(bw) for _, _, bw, _ in self.links])

    def _routes(self, src, dst):
        fis, ris = [], []
        for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
            r = self._route[(s, d)]
            fis += [i] * len(r)
            ris += r
        return np.array(fis, dtype=np.int64), np.array(ris, dtype=np.int64)

    def _latency(self, src, dst):
        return np.array(
            [sum(self.links[e][3] for e in self._route[(s, d)]) for s, d in zip(src.tolist(), dst.tolist())]
        )


# ---------------------------------------------------------------------------------------------------------
# Presets. Effective rates = nominal x achievable fraction (stated per preset).

TESTBED_EFFICIENCY = 1.0  # the testbed's figures: docs/sim.md, "Topologies"
TESTBED_LATENCY = 150e-6
LOOPBACK_BW = 1.4e9

# inter-node fabrics for presets grown beyond one node (docs/sim.md)
_IB_NDR = dict(nic_bw=0.9 * 400e9 / 8, nic_latency=15e-6)
_ROCE_200 = dict(nic_bw=0.9 * 200e9 / 8, nic_latency=20e-6)
_ROCE_400 = dict(nic_bw=0.85 * 400e9 / 8, nic_latency=20e-6)


def _a10(P=4):
    node = SwitchTopology(
        "a10-pcie-4",
        4,
        flow_bw=13e9,
        device="a10",
        port_bw=25e9,
        latency=15e-6,
        group=2,
        uplink_bw=25e9,
        source="TokenRing paper (arXiv 2412.20501) testbed: 4x A10 on PCIe 4.0 x16, two GPUs per PCIe switch "
        "(PIX) and the switches joined through the host bridge (PXB). 31.5 GB/s nominal per direction; "
        "25 GB/s effective per port and uplink; one P2P copy stream ~13 GB/s, which is what the paper's "
        "ring step implies (2*6000*32*128*2 B = 98 MB of K/V in 7.6 ms = 12.9 GB/s).",
    )
    return (
        node
        if P <= 4
        else ClusterTopology(
            "a10-pcie-4",
            P,
            device="a10",
            node=node,
            nic_bw=0.9 * 100e9 / 8,
            nic_latency=20e-6,
            nics_per_node=1,
            source=node.source + " Beyond 4 ranks: nodes joined by one 100 Gb/s NIC each (assumed).",
        )
    )


def _grown(node: Topology, P: int, fabric: dict, between: str) -> Topology:
    """``node`` itself up to its size, else a cluster of such nodes joined by ``fabric`` (NIC rate, latency)."""
    if P <= node.P:
        return node
    return ClusterTopology(
        node.name, P, device=node.device, node=node, **fabric, source=f"{node.source} Between nodes: {between}"
    )


def _hgx(P: int, name: str, device: str, gpu: str) -> Topology:
    """8 H100 / H200 SXM GPUs on NVSwitch; beyond 8, nodes joined by one 400 Gb/s InfiniBand NIC per GPU."""
    node = SwitchTopology(
        name,
        8,
        device=device,
        port_bw=0.8 * 450e9,
        latency=10e-6,
        source=f"NVIDIA {gpu} SXM datasheet: NVLink 4, 900 GB/s bidirectional per GPU through NVSwitch = 450 GB/s "
        f"per direction; 80% achievable (NCCL bus bandwidth ~360 GB/s).",
    )
    return _grown(
        node,
        P,
        _IB_NDR,
        "InfiniBand NDR 400 Gb/s per GPU (one ConnectX-7 per GPU, rail-optimised, non-blocking), 90% achievable.",
    )


def _h100(P=8, name="h100-nvswitch-8"):
    return _hgx(P, name, "h100", "H100")


def _h200(P=8):
    return _hgx(P, "h200-nvswitch-8", "h200", "H200 (kernel model: the shipped H200 attention measurements)")


def _ib(P=16):
    return _h100(P, "ib-2x8")


def _910b(P=8):
    node = MeshTopology(
        "ascend910b-mesh-8",
        8,
        device="ascend910b",
        link_bw=0.8 * 28e9,
        latency=15e-6,
        source="Huawei Atlas 800T A2 (8x Ascend 910B): HCCS full mesh, 392 GB/s per NPU over 7 peers = 56 GB/s "
        "per link bidirectional, 28 GB/s per direction; 80% achievable. Approximate public figures.",
    )
    return _grown(node, P, _ROCE_200, "200GE RoCE per NPU.")


def _mi300x(P=8):
    node = MeshTopology(
        "mi300x-mesh-8",
        8,
        device="mi300x",
        link_bw=0.75 * 64e9,
        latency=10e-6,
        source="AMD Instinct MI300X platform: 8 GPUs fully connected by 7 Infinity Fabric (xGMI) links each, "
        "128 GB/s bidirectional per link (896 GB/s aggregate) = 64 GB/s per direction; ~75% achievable "
        "(measured P2P ~48 GB/s).",
    )
    return _grown(node, P, _ROCE_400, "400GbE RoCE, one NIC per GPU, 85% achievable.")


def host_cpu_per_byte(P: int, threads: int = 1, cores: int | None = None) -> float:
    """Wall seconds a local rank spends per byte it sends or receives through the host's network stack."""
    cores = cores or os.cpu_count() or 1
    share = min(1.0, cores / max(1, P * threads))
    return cores / LOOPBACK_BW / 2 / share


def _testbed(kind: str, rate=200e6 / 8, P=4, efficiency=TESTBED_EFFICIENCY):
    bw = parse_rate(rate) * efficiency
    src = (
        f"TokenRing CPU testbed (docs/DESIGN.md): one network namespace per rank, veth links shaped by tc tbf at "
        f"{parse_rate(rate) * 8 / 1e6:g} Mbit/s per direction, x{efficiency} achieved; all traffic also "
        f"shares the host's loopback capacity ({LOOPBACK_BW / 1e9} GB/s) and costs the ranks' cores CPU time "
        f"per byte moved."
    )
    common = dict(
        device="cpu",
        latency=TESTBED_LATENCY,
        backplane_bw=LOOPBACK_BW,
        source=src,
        cpu_per_byte=host_cpu_per_byte(P),
        ready_notice=True,
        fair_share=True,
    )
    if kind == "switch":  # two veth pairs and the bridge: twice the host's work per byte
        return SwitchTopology(f"switch:{rate}", P, port_bw=bw, **dict(common, cpu_per_byte=2 * host_cpu_per_byte(P)))
    if kind == "mesh":
        return MeshTopology(f"mesh:{rate}", P, link_bw=bw, **common)
    if kind == "ring":
        return RingTopology(f"ring:{rate}", P, link_bw=bw, **common)
    raise ValueError(kind)


def _testbed_cluster(P=4, node=2, intra="400mbit", inter="100mbit", efficiency=TESTBED_EFFICIENCY):
    """The two-level testbed (``tokenring testbed --topology cluster``)."""
    n = int(node)
    mesh = MeshTopology(
        f"mesh:{intra}", n, link_bw=parse_rate(intra) * efficiency, latency=TESTBED_LATENCY, device="cpu"
    )  # (the cluster's cpu_per_byte is the one the simulator charges)
    return ClusterTopology(
        f"cluster:{n}:{intra}:{inter}",
        P,
        device="cpu",
        node=mesh,
        nic_bw=parse_rate(inter) * efficiency,
        nic_latency=TESTBED_LATENCY,
        nics_per_node=1,
        cpu_per_byte=host_cpu_per_byte(P),
        ready_notice=True,
        fair_share=True,
        source=f"TokenRing two-level CPU testbed: nodes of {n} ranks (one namespace each) joined by a mesh of veth "
        f"links shaped at {intra} per direction; each node's inter-node traffic leaves through one NIC "
        f"(a router namespace) whose link to a switch is shaped at {inter} per direction. Ranks' cores "
        f"pay CPU time per byte moved, as on the flat testbed.",
    )


def _loopback(P=4):
    return SwitchTopology(
        "loopback",
        P,
        device="cpu",
        port_bw=LOOPBACK_BW,
        latency=100e-6,
        backplane_bw=LOOPBACK_BW,
        cpu_per_byte=host_cpu_per_byte(P),
        ready_notice=True,
        fair_share=True,
        source="Local gloo ranks on one CPU host (docs/DESIGN.md: ~1.4 GB/s through loopback in "
        "total, sending both ways at once gives no more).",
    )


# GPU models by name, for a topology built from the machine (docs/sim.md)
_GPU_MODELS = (  # (name contains, kernel model, NVLink B/s per direction)
    ("H200", "h200", 450e9),
    ("H100", "h100", 450e9),
    ("H800", "h100", 200e9),
    ("GH200", "h200", 450e9),
    ("B200", "b200", 900e9),
    ("B100", "b200", 900e9),
    ("A100", "a100", 300e9),
    ("A800", "a100", 200e9),
    ("L40", "l40s", 0.0),
    ("A10", "a10", 0.0),
    ("MI300", "mi300x", 0.0),
)
_PCIE_GEN = {"h100": 64e9, "h200": 64e9, "b200": 64e9}  # x16 per direction: Gen5 on these, Gen4 elsewhere


def gpu_model(name: str) -> tuple[str, float, str]:
    """``(kernel model, NVLink B/s per direction, note)`` for a GPU's name; unknown GPUs get the H100's (said so)."""
    for key, device, nvlink in _GPU_MODELS:
        if key in name.upper():
            return device, nvlink, f"{name}: kernel model {device}"
    return "h100", 450e9, f"{name}: unknown GPU, using the H100 kernel model and NVLink figures"


def detected_topology(gpu, P: int) -> Topology:
    """The topology of ``P`` ranks on GPUs like ``gpu`` (a :class:`tokenring.device.GPU`): docs/sim.md."""
    device, nvlink, note = gpu_model(gpu.name)
    n = max(1, min(int(gpu.per_node or P), P))
    name = f"detected-{device}-{gpu.link}-{n}"
    if device == "mi300x" and gpu.link == "nvlink":
        node = _mi300x(n)
        node = MeshTopology(name, n, device="mi300x", link_bw=node.link_bw, latency=node.latency, source=node.source)
    elif gpu.link == "nvlink":
        node = SwitchTopology(
            name,
            n,
            device=device,
            port_bw=0.8 * nvlink,
            latency=10e-6,
            source=f"{note}; NVLink/NVSwitch {nvlink / 1e9:.0f} GB/s per direction, 80% achievable",
        )
    else:
        pcie = _PCIE_GEN.get(device, 32e9)
        node = SwitchTopology(
            name,
            n,
            device=device,
            port_bw=0.8 * pcie,
            latency=15e-6,
            group=2 if n > 2 else 0,
            uplink_bw=0.8 * pcie,
            source=f"{note}; PCIe x16 {pcie / 1e9:.0f} GB/s per direction, 80% achievable, two GPUs per PCIe switch",
        )
    return _grown(node, P, _IB_NDR, "InfiniBand NDR 400 Gb/s per GPU, 90% achievable (assumed, not detected).")


PRESETS = {
    "a10-pcie-4": _a10,
    "h100-nvswitch-8": _h100,
    "h200-nvswitch-8": _h200,
    "ascend910b-mesh-8": _910b,
    "mi300x-mesh-8": _mi300x,
    "ib-2x8": _ib,
    "switch": lambda P=4, rate="200mbit": _testbed("switch", rate, P),
    "ring": lambda P=4, rate="200mbit": _testbed("ring", rate, P),
    "mesh": lambda P=4, rate="200mbit": _testbed("mesh", rate, P),
    "cluster": _testbed_cluster,
    "loopback": _loopback,
}
_DEFAULT_P = {
    "a10-pcie-4": 4,
    "h100-nvswitch-8": 8,
    "h200-nvswitch-8": 8,
    "ascend910b-mesh-8": 8,
    "mi300x-mesh-8": 8,
    "ib-2x8": 16,
}


def preset_names() -> list[str]:
    return list(PRESETS)


PROFILE_FORMAT = "tokenring-profile/1"  # a calibration profile file (tokenring.calibrate): topology + kernel


def topology_to_dict(topo: Topology) -> dict:
    """JSON-ready form of a switch, mesh or ring topology; the inverse of :func:`topology_from_dict`."""
    kinds = {SwitchTopology: "switch", MeshTopology: "mesh", RingTopology: "ring"}
    if type(topo) not in kinds:
        raise ValueError(f"only switch, mesh and ring topologies are written out, not {type(topo).__name__}")
    skip = {"preset", "preset_kw", "kernel", "measured"}
    out = {"kind": kinds[type(topo)]}
    for f in fields(topo):
        v = getattr(topo, f.name)
        if f.name in skip or (isinstance(v, float) and v == INF):
            continue
        out[f.name] = v
    return out


def _profile(d: dict, P: int | None) -> Topology:
    """The topology of a calibration profile, carrying its measured kernel model and measurements."""
    if d.get("format") != PROFILE_FORMAT:
        raise ValueError(f"profile format {d.get('format')!r} unknown (this version reads {PROFILE_FORMAT!r})")
    topo = topology_from_dict(d["topology"], P)
    topo.kernel = model_from_dict(d["kernel"])
    topo.measured = dict(d.get("measured", {}), machine=d.get("machine", {}))
    return topo


def topology_from_dict(d: dict, P: int | None = None) -> Topology:
    """A topology from JSON/YAML data: a preset with a rate, or a kind with its parameters (examples:
    docs/sim.md, "Topologies")."""
    d = dict(d)
    if "format" in d:
        return _profile(d, P)
    if "preset" in d:
        name = d.pop("preset")
        kw = {k: d[k] for k in ("rate",) if k in d}
        return _preset(name, P or d.get("P"), **kw)
    kind = d.pop("kind", None)
    name = d.pop("name", kind or "custom")
    n = int(P or d.pop("P", 0) or 0)
    d.pop("P", None)
    common = dict(
        name=name,
        P=n,
        flow_bw=parse_rate(d.pop("flow_bw", INF)),
        device=d.pop("device", "cpu"),
        source=d.pop("source", "user-defined"),
        cpu_per_byte=float(d.pop("cpu_per_byte", 0.0)),
        queued=bool(d.pop("queued", True)),
        fair_share=bool(d.pop("fair_share", False)),
        ready_notice=bool(d.pop("ready_notice", False)),
    )
    rates = {k: parse_rate(d.pop(k)) for k in list(d) if k.endswith("_bw")}
    times = {k: parse_time(d.pop(k)) for k in list(d) if k.endswith("latency")}
    if kind == "switch":
        return SwitchTopology(**common, **rates, **times, group=int(d.pop("group", 0)))
    if kind == "mesh":
        return MeshTopology(**common, **rates, **times)
    if kind == "ring":
        return RingTopology(**common, **rates, **times)
    if kind == "cluster":
        node = topology_from_dict(d.pop("node"))
        return ClusterTopology(**common, node=node, **rates, **times, nics_per_node=int(d.pop("nics_per_node", 0)))
    if kind == "graph":
        links = []
        duplex = bool(d.pop("duplex", True))
        for item in d.pop("links"):
            if isinstance(item, dict):
                u, v, bw, lat = item["src"], item["dst"], item.get("bw"), item.get("latency", 0)
            else:
                u, v, bw, lat = (list(item) + [0])[:4]
            u = int(u) if isinstance(u, (int, float)) or str(u).isdigit() else u
            v = int(v) if isinstance(v, (int, float)) or str(v).isdigit() else v
            links.append((u, v, parse_rate(bw), parse_time(lat)))
            if duplex:
                links.append((v, u, parse_rate(bw), parse_time(lat)))
        return GraphTopology(**common, links=links)
    raise ValueError(
        f"topology kind {kind!r} unknown; use switch, mesh, ring, cluster, graph or a preset ({', '.join(PRESETS)})"
    )


def _preset(name: str, P: int | None = None, **kw) -> Topology:
    if name not in PRESETS:
        raise ValueError(
            f"unknown topology preset {name!r}; choose one of {', '.join(PRESETS)}, a JSON/YAML file, "
            f"or 'switch:RATE' / 'ring:RATE' / 'mesh:RATE'"
        )
    P = int(P) if P else _DEFAULT_P.get(name, 4)
    topo = PRESETS[name](P=P, **kw)
    topo.preset, topo.preset_kw = name, dict(kw)
    return topo


def get_topology(spec, P: int | None = None) -> Topology:
    """A topology from a :class:`Topology`, a dict, a preset name, ``"kind:RATE"``, a JSON/YAML file or a
    calibration profile."""
    if isinstance(getattr(spec, "topology", None), Topology):  # a calibration Profile
        spec = spec.topology
    if isinstance(spec, Topology):
        return spec if P is None or P == spec.P else spec.with_P(P)
    if isinstance(spec, dict):
        return topology_from_dict(spec, P)
    spec = str(spec).strip()
    if spec.endswith((".json", ".yaml", ".yml")) or os.path.sep in spec:
        with open(spec) as f:
            text = f.read()
        if spec.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # optional dependency, only for YAML files

            data = yaml.safe_load(text)
        return topology_from_dict(data, P)
    name, _, rate = spec.partition(":")
    if name == "cluster" and rate:  # the two-level testbed: cluster:NODE:INTRA:INTER
        parts = rate.split(":")
        if len(parts) != 3 or not parts[0].isdigit():
            raise ValueError(
                f"a two-level testbed is 'cluster:NODE:INTRA:INTER' (ranks per node, intra- and "
                f"inter-node rates), e.g. 'cluster:2:400mbit:100mbit'; got {spec!r}"
            )
        return _preset(name, P, node=int(parts[0]), intra=parts[1], inter=parts[2])
    if rate:
        if name not in ("switch", "ring", "mesh"):
            raise ValueError(f"only the testbed kinds take a rate ('switch:200mbit'), not {name!r}")
        return _preset(name, P, rate=rate)
    return _preset(name, P)


def profile_summary(topo: Topology) -> str:
    """Lines for ``explain``: the measured figures of a calibrated topology next to what it predicts."""
    m = topo.measured or {}
    if not m:
        return ""
    mach = m.get("machine", {})
    pairs = list(m.get("pair_Bps", {}).values())
    lines = [
        f"profile: measured on {mach.get('host', '?')} ({mach.get('cpu', '?')}, {mach.get('cores', '?')} cores, "
        f"torch {mach.get('torch', '?')}{', ' + mach['gpu'] if mach.get('gpu') else ''}), P={m.get('P')}, "
        f"in {m.get('total_s', 0):.1f} s",
    ]
    if pairs:
        lats = list(m["latency_s"].values())
        lines.append(
            f"  links: pair rate {statistics.median(pairs) / 1e6:.4g} MB/s median ({min(pairs) / 1e6:.4g}-"
            f"{max(pairs) / 1e6:.4g}), latency {statistics.median(lats) * 1e6:.0f} us; compute per byte moved "
            f"{m.get('compute_per_byte_s', 0) * 1e9:.3g} ns; host time per step {m.get('step_s', 0) * 1e3:.3g} ms"
            + (f"; link rates in calls x{m['link_factor']:.3g}" if "link_factor" in m else "")
        )
        lines.append(
            "  link models, mean |log error| over the patterns (and the real calls): "
            + ", ".join(
                f"{k['kind']} {k['error']:.3f}" + (f" ({k['calls_error']:.3f})" if "calls_error" in k else "")
                for k in m.get("kinds", [])
                if "calls_error" in k
            )
        )
        lines.append(f"  {'pattern':<14}{'measured':>12}{'model':>12}")
        for n, p in m.get("patterns", {}).items():
            lines.append(f"  {n:<14}{p['measured_s'] * 1e3:>10.3g}ms{p['predicted_s'] * 1e3:>10.3g}ms")
    if m.get("calls"):
        lines.append(f"  {'call (fwd)':<28}{'measured':>10}{'model':>10}{'factor':>8}")
        for n, c in m["calls"].items():
            lines.append(
                f"  {n:<28}{c['measured_s'] * 1e3:>8.4g}ms{c['predicted_s'] * 1e3:>8.4g}ms{c.get('factor', 1.0):>8.3f}"
            )
    rows = m.get("kernel_rows", [])
    if rows:
        lines.append(f"  {'block':<16}{'fwd meas':>10}{'model':>10}{'bwd meas':>10}{'model':>10}")
        for r in rows:
            tag = f"n={r['n']}{' causal' if r['causal'] else ''}"
            lines.append(
                f"  {tag:<16}{r['k_fwd_ms']:>8.3g}ms{r['model_fwd_ms']:>8.3g}ms"
                f"{r['k_fb_ms'] - r['k_fwd_ms']:>8.3g}ms{r['model_bwd_ms']:>8.3g}ms"
            )
    return "\n".join(lines)


settings.add_check("topology", get_topology)
