"""``tokenring testbed``: the benchmark over emulated interconnects (root only).

    sudo tokenring testbed --topology mesh switch --rate 200 [100 ...] [bench options: -P 4 --seq 4096 ...]

One network namespace per rank, joined by veth links whose every direction is shaped with ``tc tbf`` (so a
link is full duplex: each direction has the full rate). Topologies:

- ``switch``: each rank has one link to a bridge living in a hub namespace (PCIe switch / NVSwitch): a rank's
  out-port and in-port each carry ``rate``, shared by all its peers;
- ``ring``: links only between neighbours ``r`` and ``r + 1``; traffic to other ranks is forwarded hop by hop
  along the shorter way round;
- ``mesh``: a dedicated link per pair (Ascend HCCS / AMD xGMI): traffic to each peer is routed over that
  pair's own link;
- ``cluster``: two levels. Nodes of ``node`` ranks (``--node``); inside a node a mesh of links at
  ``intra`` Mbit/s (``--intra``, default 4x the rate); each node has one NIC: a router namespace that the
  node's ranks reach over unshaped veths and whose single link to a switch (a bridge in a hub namespace) is
  shaped at ``rate`` in each direction, so all of a node's inter-node traffic shares that one slower link.

Addressing: rank ``r`` owns ``10.77.0.<r+1>`` (a /32 on one of its veth ends for ring/mesh, a /24 on its
single port for switch); each peer's /32 is routed over the right link with ``src`` set, so gloo, bound to
the interface holding the identity address (``GLOO_SOCKET_IFNAME``), uses the topology's links. Nothing is
created outside these namespaces, so deleting them removes every link and qdisc; that happens on exit, on
error, on Ctrl-C / SIGTERM (handlers) and at interpreter exit (atexit), and touches only names with this
process's unique prefix ``trtb-<pid>-<n>``. No traffic leaves the namespaces.

Per-direction latency needs the ``netem`` qdisc; where the kernel lacks it (as on the machine this was
written on) ``--delay-ms`` is refused with that reason.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys

__all__ = ["Testbed", "TOPOLOGIES", "available", "cleanup_stale", "main"]

TOPOLOGIES = ("switch", "ring", "mesh", "cluster")
_counter = itertools.count()
_live: list["Testbed"] = []


def available() -> str | None:
    """``None`` when the testbed can run here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the testbed needs root (it creates network namespaces, veth links and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the testbed needs the `{tool}` tool (iproute2), which is not installed"
    return None


MTU = 65535  # veth's largest
QUEUE_BYTES = 64 << 20  # per shaped link direction: more than the TCP send buffers of all flows that share it


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"testbed: `{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


class Testbed:
    """P namespaces joined by shaped veth links. Use as a context manager::

    with Testbed(4, "mesh", rate_mbit=200) as tb:
        bench.run(spec, **tb.launch_kwargs())
    """

    def __init__(
        self,
        P: int,
        topology: str,
        rate_mbit: float,
        delay_ms: float = 0.0,
        queue_ms: float | None = None,
        prefix: str | None = None,
        node: int = 0,
        intra_mbit: float | None = None,
    ):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology {topology!r} is unknown; choose one of {TOPOLOGIES}")
        if topology == "cluster" and (node < 1 or P % node or node == P):
            raise ValueError(
                f"the cluster testbed needs nodes of `node` ranks dividing P={P} into at least two "
                f"nodes, got node={node}"
            )
        self.node = node if topology == "cluster" else 0
        self.intra = (intra_mbit or 4 * rate_mbit) if topology == "cluster" else None
        if P < 2 or P > 200:
            raise ValueError(f"the testbed needs 2 <= P <= 200 ranks, got {P}")
        if rate_mbit <= 0:
            raise ValueError(f"rate must be positive (Mbit/s), got {rate_mbit}")
        self.P, self.topology, self.rate, self.delay_ms, self.queue_ms = P, topology, rate_mbit, delay_ms, queue_ms
        self.prefix = prefix or f"trtb-{os.getpid()}-{next(_counter)}"
        self.namespaces: list[str] = []  # created by us, deleted in teardown
        self.iface: dict[int, str] = {}
        self.links: list[tuple[str, str]] = []  # (namespace, device) of every shaped veth end

    # ------------------------------------------------------------------ names
    def ns(self, r: int) -> str:
        return f"{self.prefix}-r{r}"

    @property
    def hub(self) -> str:
        return f"{self.prefix}-sw"

    def router(self, a: int) -> str:
        return f"{self.prefix}-n{a}"

    @staticmethod
    def addr(r: int) -> str:
        return f"10.77.{r // 250}.{r % 250 + 1}"

    @staticmethod
    def router_addr(a: int) -> str:
        return f"10.78.{a // 250}.{a % 250 + 1}"

    # ------------------------------------------------------------------ setup
    def _ns_add(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._in(name, "ip", "link", "set", "dev", "lo", "up")
        # No TCP slow start after an idle gap: an interconnect link does not ramp up again between messages, and
        # schedules that pause a link between messages would otherwise pay a fresh ramp each time.
        for key in (
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.ip_forward=1",
            "net.ipv4.tcp_slow_start_after_idle=0",
        ):
            self._in(name, "sysctl", "-q", "-w", key, check=False)

    def _in(self, ns: str, *cmd: str, check: bool = True):
        return _sh("ip", "netns", "exec", ns, *cmd, check=check)

    def _veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        _sh("ip", "-n", ns_a, "link", "add", "name", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
            # 64 KB frames: the host's cores move the bytes of every emulated link, per packet; big frames keep
            # that cost small next to the attention compute sharing those cores (an interconnect's DMA costs none)
            _sh("ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(MTU), "up")

    def _shape(self, ns: str, dev: str, rate: float | None = None) -> None:
        rate = rate or self.rate
        rate_bytes = rate * 1e6 / 8
        # 2 ms of traffic, and at least one full frame (tbf never sends a frame larger than its bucket). The bucket
        # is what an idle link may send at line rate: keep it to about one frame so that small messages do not
        # travel faster than the rate after a pause (a 256 KB bucket made 256 KB chunks nearly free at 70 Mbit/s).
        burst = max(MTU + 4096, int(rate_bytes * 0.002))
        # The queue: by default big enough never to drop (QUEUE_BYTES). Interconnects are lossless (credit flow
        # control); a tbf that drops makes TCP retransmit, and a lost tail costs a 200 ms timeout: with a 100 ms
        # queue, links at ~50 Mbit/s shared by several flows dropped hundreds of packets per run and some calls
        # measured 1.5x slower than their siblings. ``queue_ms`` sets a time-bounded (dropping) queue instead.
        queue = ["latency", f"{self.queue_ms}ms"] if self.queue_ms else ["limit", str(QUEUE_BYTES)]
        tbf = ["tbf", "rate", f"{rate}mbit", "burst", str(burst), *queue]
        if self.delay_ms > 0:
            self._in(
                ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"
            )
            self._in(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
        else:
            self._in(ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)
        self.links.append((ns, dev))

    def _pairs(self) -> list[tuple[int, int]]:
        P = self.P
        if self.topology == "mesh":
            return [(i, j) for i in range(P) for j in range(i + 1, P)]
        return sorted({tuple(sorted((i, (i + 1) % P))) for i in range(P)})

    def _next_hop(self, i: int, j: int) -> int:
        if self.topology == "mesh":
            return j
        fwd = (j - i) % self.P
        return (i + 1) % self.P if fwd <= self.P - fwd else (i - 1) % self.P

    def setup(self) -> "Testbed":
        why = available()
        if why:
            raise RuntimeError(f"testbed: {why}")
        if self.delay_ms > 0 and not self._has_netem():
            raise RuntimeError(
                "testbed: --delay-ms needs the netem qdisc, which this kernel does not provide "
                "(tc says 'Specified qdisc kind is unknown'); run without a delay"
            )
        _live.append(self)
        try:
            for r in range(self.P):
                self._ns_add(self.ns(r))
            if self.topology == "switch":
                self._setup_switch()
            elif self.topology == "cluster":
                self._setup_cluster()
            else:
                self._setup_links()
        except BaseException:
            self.teardown()
            raise
        return self

    def _has_netem(self) -> bool:
        probe = f"{self.prefix}-probe"
        try:
            self._ns_add(probe)
            _sh("ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
            return (
                self._in(
                    probe, "tc", "qdisc", "add", "dev", "a", "root", "netem", "delay", "1ms", check=False
                ).returncode
                == 0
            )
        finally:
            _sh("ip", "netns", "del", probe, check=False)
            if probe in self.namespaces:
                self.namespaces.remove(probe)

    def _setup_switch(self) -> None:
        self._ns_add(self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "name", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "dev", "br0", "up")
        for r in range(self.P):
            port = f"r{r}"
            self._veth(self.ns(r), "eth0", self.hub, port)
            _sh("ip", "-n", self.hub, "link", "set", "dev", port, "master", "br0")
            _sh("ip", "-n", self.ns(r), "addr", "add", f"{self.addr(r)}/16", "dev", "eth0")
            self.iface[r] = "eth0"
            self._shape(self.ns(r), "eth0")  # rank -> switch
            self._shape(self.hub, port)  # switch -> rank

    def _setup_links(self) -> None:
        for i, j in self._pairs():
            self._veth(self.ns(i), f"p{j}", self.ns(j), f"p{i}")
            self._shape(self.ns(i), f"p{j}")
            self._shape(self.ns(j), f"p{i}")
        for i in range(self.P):
            first = min(j for a, b in self._pairs() for j in (a, b) if i in (a, b) and j != i)
            self.iface[i] = f"p{first}"
            _sh("ip", "-n", self.ns(i), "addr", "add", f"{self.addr(i)}/32", "dev", self.iface[i])
        for i in range(self.P):
            for j in range(self.P):
                if i == j:
                    continue
                nh = self._next_hop(i, j)
                route = ["ip", "-n", self.ns(i), "route", "add", f"{self.addr(j)}/32"]
                if nh == j:
                    route += ["dev", f"p{j}"]
                else:
                    route += ["via", self.addr(nh), "dev", f"p{nh}", "onlink"]
                _sh(*route, "src", self.addr(i))

    def _setup_cluster(self) -> None:
        n, m = self.node, self.P // self.node
        self._ns_add(self.hub)
        _sh("ip", "-n", self.hub, "link", "add", "name", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "dev", "br0", "up")
        for a in range(m):  # each node's NIC: a router with one shaped link to the switch
            nic = self.router(a)
            self._ns_add(nic)
            self._veth(nic, "sw", self.hub, f"n{a}")
            _sh("ip", "-n", self.hub, "link", "set", "dev", f"n{a}", "master", "br0")
            _sh("ip", "-n", nic, "addr", "add", f"{self.router_addr(a)}/32", "dev", "sw")
            self._shape(nic, "sw")  # node -> switch
            self._shape(self.hub, f"n{a}")  # switch -> node
        for r in range(self.P):  # each rank: an unshaped link to its node's NIC, its identity address on it
            a = r // n
            self._veth(self.ns(r), "up", self.router(a), f"r{r}")
            _sh("ip", "-n", self.ns(r), "addr", "add", f"{self.addr(r)}/32", "dev", "up")
            _sh("ip", "-n", self.router(a), "route", "add", f"{self.addr(r)}/32", "dev", f"r{r}")
            self.iface[r] = "up"
        for a in range(m):  # the mesh inside each node
            for i, j in itertools.combinations(range(a * n, (a + 1) * n), 2):
                self._veth(self.ns(i), f"p{j}", self.ns(j), f"p{i}")
                self._shape(self.ns(i), f"p{j}", self.intra)
                self._shape(self.ns(j), f"p{i}", self.intra)
        for i in range(self.P):
            for j in range(self.P):
                if i == j:
                    continue
                if i // n == j // n:
                    route = ["dev", f"p{j}"]
                else:
                    route = ["via", self.router_addr(i // n), "dev", "up", "onlink"]
                _sh("ip", "-n", self.ns(i), "route", "add", f"{self.addr(j)}/32", *route, "src", self.addr(i))
        for a in range(m):  # a router sends another node's ranks to that node's router
            for j in range(self.P):
                if j // n != a:
                    _sh(
                        "ip",
                        "-n",
                        self.router(a),
                        "route",
                        "add",
                        f"{self.addr(j)}/32",
                        "via",
                        self.router_addr(j // n),
                        "dev",
                        "sw",
                        "onlink",
                    )

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Delete every namespace we created (with them go their veth links, bridge and qdiscs). Idempotent."""
        errors = []
        for name in reversed(self.namespaces):
            p = _sh("ip", "netns", "del", name, check=False)
            if p.returncode != 0 and name in _list_namespaces():
                errors.append(f"{name}: {p.stderr.strip()}")
        self.namespaces.clear()
        self.links.clear()
        if self in _live:
            _live.remove(self)
        if errors:
            raise RuntimeError("testbed: could not delete " + "; ".join(errors))

    def __enter__(self) -> "Testbed":
        self._old = {}
        if _is_main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old[sig] = signal.signal(sig, _raise_exit)
        return self.setup()

    def __exit__(self, *exc) -> None:
        try:
            self.teardown()
        finally:
            for sig, old in self._old.items():
                signal.signal(sig, old)

    # ------------------------------------------------------------------ running ranks inside
    def launch_kwargs(self) -> dict:
        """Arguments for :func:`tokenring.tools.bench.launch` / ``run`` that put rank ``r`` in namespace ``r``
        with gloo bound to its link. The ranks rendezvous through a file store (namespaces share the file
        system), so no address or port is needed."""
        # The ranks' cost model (strategy "auto", "token_ring") sees this testbed unless the caller chose one.
        topo = os.environ.get("TOKENRING_TOPOLOGY") or self.spec()
        extra = {"LOCAL_WORLD_SIZE": str(self.node)} if self.node else {}  # as torchrun would set it
        return dict(
            prefix=lambda r: ["ip", "netns", "exec", self.ns(r)],
            env=lambda r: {
                "GLOO_SOCKET_IFNAME": self.iface[r],
                "TP_SOCKET_IFNAME": self.iface[r],
                "TOKENRING_TOPOLOGY": topo,
                **extra,
            },
        )

    def spec(self) -> str:
        """This testbed as a ``tokenring.sim`` topology spec (``"mesh:200mbit"``,
        ``"cluster:2:400mbit:100mbit"``)."""
        if self.node:
            return f"cluster:{self.node}:{self.intra:g}mbit:{self.rate:g}mbit"
        return f"{self.topology}:{self.rate:g}mbit"

    def dropped(self) -> int:
        """Packets the shaped links have dropped so far (0 with the default lossless queue)."""
        total = 0
        for ns, dev in self.links:
            out = self._in(ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
            total += sum(int(x) for x in re.findall(r"dropped (\d+)", out))
        return total

    def describe(self) -> dict:
        out = dict(
            topology=self.topology,
            P=self.P,
            rate_mbit=self.rate,
            rate_MBps=self.rate / 8,
            delay_ms=self.delay_ms,
            shaping="tc tbf per direction (full duplex), veth, "
            + (f"{self.queue_ms:g} ms queue" if self.queue_ms else "lossless queue"),
            links=len(self.links),
            spec=self.spec(),
        )
        if self.node:
            out.update(node=self.node, intra_mbit=self.intra)
        return out


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _list_namespaces() -> list[str]:
    p = _sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def cleanup_stale() -> list[str]:
    """Delete namespaces ``trtb-<pid>-...`` left by a testbed process that no longer exists (killed with
    SIGKILL, so it could not clean up). Namespaces of live processes and any other name are left alone."""
    removed = []
    for name in _list_namespaces():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "trtb" or not parts[1].isdigit():
            continue
        if os.path.exists(f"/proc/{parts[1]}"):
            continue
        if _sh("ip", "netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


@atexit.register
def _cleanup_all() -> None:
    for tb in list(_live):
        try:
            tb.teardown()
        except Exception as e:  # pragma: no cover - best effort at exit
            print(f"testbed cleanup: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from . import bench

    ap = argparse.ArgumentParser(prog="tokenring testbed", description=__doc__.splitlines()[0])
    ap.add_argument("--topology", nargs="+", default=["mesh", "switch"], choices=TOPOLOGIES)
    ap.add_argument("--rate", type=float, nargs="+", default=[200.0], help="link rate(s), Mbit/s per direction")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way latency per direction (needs netem)")
    ap.add_argument("--node", type=int, default=2, help="cluster: ranks per node")
    ap.add_argument("--intra", type=float, default=None, help="cluster: intra-node link rate, Mbit/s (default 4x)")
    ap.add_argument(
        "--cleanup",
        action="store_true",
        help="only delete namespaces left behind by a testbed process that was killed, then exit",
    )
    bench.add_args(ap)
    a = ap.parse_args(argv)
    why = available()
    if why:
        print(
            f"tokenring testbed: {why}. Run it as root (sudo), or use `tokenring bench` for unshaped local ranks.",
            file=sys.stderr,
        )
        return 2
    if a.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    cases = [(topo, rate, spec) for topo in a.topology for rate in a.rate for spec in bench.specs_from_args(a)]
    results = []
    try:
        from rich.progress import Progress

        prog = Progress(transient=True) if len(cases) > 1 else None
    except ImportError:
        prog = None
    try:
        if prog:
            prog.start()
            task = prog.add_task("testbed", total=len(cases))
        for topo, rate, spec in cases:
            if prog:
                prog.update(task, description=f"{topo} {rate:g} Mbit/s S={spec['S']}")
            with Testbed(spec["P"], topo, rate, a.delay_ms, node=a.node, intra_mbit=a.intra) as tb:
                res = bench.run(spec, **tb.launch_kwargs())
                res["testbed"] = tb.describe()
            results.append(res)
            if prog:
                prog.advance(task)
    except RuntimeError as e:
        print(f"tokenring testbed: {e}", file=sys.stderr)
        return 1
    finally:
        if prog:
            prog.stop()

    def title(res):
        t = res["testbed"]
        return f"{t['topology']} @ {t['rate_mbit']:g} Mbit/s per direction: {bench.describe(res['spec'])}"

    def tag(res):
        t = res["testbed"]
        return f"{t['topology']}_{t['rate_mbit']:g}mbit_S{res['spec']['S']}_"

    return bench.report(results, a, title, tag)


if __name__ == "__main__":
    raise SystemExit(main())
