"""Local rank launching (tokenring.tools.launch): the pool's results and errors, ranks that exit or hang, and
that a local run listens on nothing beyond loopback."""

import ipaddress
import os
import socket
import threading
import time

import pytest

from tokenring.tools import bench
from tokenring.tools.launch import RankError, RankPool, spawn


# ------------------------------------------------------------------ listening sockets, from /proc
def _addr(hexaddr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hexaddr)
    # /proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) order
    return ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))


def listening(pid) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket (state 0A) the process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:  # the process's own network namespace
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    host, port = cols[1].split(":")
                    out.append((str(_addr(host)), int(port, 16)))
    return out


def beyond_loopback(socks) -> list[tuple[str, int]]:
    def loopback(a):
        a = ipaddress.ip_address(a)
        return a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)

    return [(a, p) for a, p in socks if not loopback(a)]


def _rank_listening(rank, P):
    return listening(os.getpid())


def test_listening_check_sees_wildcard_sockets():
    """The check can fail: a socket on every interface, and torch's TCP store (the old rendezvous), are caught."""
    import torch.distributed as dist

    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        s.listen()
        assert ("::", s.getsockname()[1]) in beyond_loopback(listening(os.getpid()))
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    try:
        assert any(p == store.port for _, p in beyond_loopback(listening(os.getpid()))), listening(os.getpid())
    finally:
        del store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listening(os.getpid())
        assert beyond_loopback(listening(os.getpid())) == []


def test_local_ranks_listen_only_on_loopback(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with RankPool(2, threads=1, timeout=120) as pool:
        socks = pool.run(_rank_listening)
    for r, s in enumerate(socks):
        assert beyond_loopback(s) == [], f"rank {r} listens beyond loopback: {s}"


def _children_listening(stop: threading.Event, seen: list) -> None:
    me = str(os.getpid())
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
                if ppid == me:
                    seen.extend(listening(pid))
            except (OSError, IndexError):
                continue  # exited meanwhile
        time.sleep(0.01)


def test_bench_ranks_listen_only_on_loopback(monkeypatch):
    """The subprocess launcher (bench, testbed), watched from the parent while its ranks run."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    spec = bench.make_spec(
        P=2, S=32, H=2, d=8, strategies=["ring"], repeats=2, warmup=0, trace=False, comm_only=False, timeout=60
    )
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_children_listening, args=(stop, seen), daemon=True)
    watcher.start()
    try:
        res = bench.run(spec)
    finally:
        stop.set()
        watcher.join()
    assert res["results"][0]["check"]["ok"]
    assert seen, "saw no listening socket of the ranks at all (gloo keeps one): the check is blind"
    assert beyond_loopback(seen) == [], set(seen)


# ------------------------------------------------------------------ pool behaviour
def _echo(rank, P, x):
    return (rank, P, x)


def _fail_odd(rank, P):
    if rank % 2:
        raise ValueError(f"boom on {rank}")
    return rank


def _exit_rank(rank, P, who):
    if rank == who:
        os._exit(3)
    return rank


def _sleep_rank(rank, P, who, seconds):
    if rank == who:
        time.sleep(seconds)
    return rank


def test_pool_results_errors_and_recovery():
    with RankPool(2, threads=1, timeout=60) as pool:
        assert pool.run(_echo, "x") == [(0, 2, "x"), (1, 2, "x")]
        with pytest.raises(RankError, match=r"(?s)--- rank 1 ---.*ValueError: boom on 1"):
            pool.run(_fail_odd)
        assert pool.run(_echo, 1) == [(0, 2, 1), (1, 2, 1)]  # an exception leaves the ranks serving
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1 exited with code 3"):
            pool.run(_exit_rank, 1)
        assert time.monotonic() - t0 < 30  # found dead, not waited for
        assert pool.run(_echo, 2) == [(0, 2, 2), (1, 2, 2)]  # fresh ranks
    with pytest.raises(RankError, match="closed"):
        pool.run(_echo, 3)


def test_hung_rank_fails_within_timeout():
    with RankPool(2, threads=1, timeout=120) as pool:
        # started first (a loaded host can take seconds to start a rank: that must not count as rank 0 hanging)
        assert pool.run(_echo, "up") == [(0, 2, "up"), (1, 2, "up")]
        pool.timeout = 2
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"ranks \[1\] gave no answer within 2 s"):
            pool.run(_sleep_rank, 1, 4)
        assert time.monotonic() - t0 < 10


def test_spawn_gives_none_for_a_rank_that_exits():
    assert spawn(_exit_rank, 3, 2, threads=1) == [0, 1, None]
    assert spawn(_echo, 2, "y", threads=1) == [(0, 2, "y"), (1, 2, "y")]
