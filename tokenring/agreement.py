"""The cross-rank agreement: before ranks move data for a call, they check they make the same call.

Each rank puts what must agree (shapes, options, checksums of values) in one row of numbers; one all-gather
brings every row to every rank (:func:`exchange`), and :func:`require_same` raises the same ``ValueError`` on
every rank when a row differs, naming the rank and the fields. A rank that never arrives is named too: each
marks its arrival in the rendezvous store when an exchange does not finish at once (ranks in step skip that
round trip), so the ones still waiting can say who is missing. attention, decode,
extend and the Hugging Face checks all agree through here.
"""

from __future__ import annotations

import datetime
import math
import time
import zlib
from typing import Callable, Sequence

import torch

from .comm import (
    all_gather_into,
    done_reading,
    get_timeout,
    group_store,
    guard_exit,
    mark_process,
    marked,
    publish_refusal,
)
from .device import collective_device, values_travel

__all__ = [
    "code",
    "checksum",
    "exchange",
    "ranks_differing",
    "odd_ones",
    "require_same",
    "refuse_at_exchange",
    "differences",
    "Verified",
    "forget_groups",
]

_ARRIVAL_WAIT_S = 1.0  # after an early failure, how long to wait for the others' arrival marks
_exchanges: dict = {}  # per group: exchanges so far (the same count on every rank in step)
_ARRIVED = "tokenring/arrived/"  # + rank: the store key holding the latest exchange that rank reached


def code(x) -> float:
    """A number for ``str(x)`` that is the same in every process (``hash()`` is not)."""
    return float(zlib.crc32(str(x).encode()))


_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> float:
    """A number for a tensor's values, shape and dtype, the same in every process. Computed where the tensor
    lives (one number comes to the host) and position-weighted, so a permutation differs too."""
    if t.device.type == "meta":  # no values (the fake-CUDA tier: its process group moves none either)
        return code(f"{tuple(t.shape)} {t.dtype}")
    x = t.detach().reshape(-1)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        x = x.contiguous().view(_AS_INT[x.element_size()])  # the bits
    x = x.to(torch.int64)
    p = 1000003
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) % p
    total = int(((x % p) * w).sum().item()) if x.numel() else 0
    return code(f"{total} {tuple(t.shape)} {t.dtype}")


def exchange(row: Sequence[float], group, rank: int, P: int, who: str, what: str) -> list[list[float]] | None:
    """Every rank's ``row`` (float64), in rank order; ``None`` on PyTorch's fake process group, whose
    collectives move no values. ``RuntimeError`` naming the ranks that never arrived when the exchange does not
    finish within the timeout (:func:`tokenring.get_timeout`)."""
    mine = torch.tensor(list(row), dtype=torch.float64, device=collective_device(group))
    every = mine.new_empty((P, len(mine)))
    n = _exchanges[id(group)] = _exchanges.get(id(group), -1) + 1
    guard_exit(group)
    mark_process(group, rank)  # this process, for a failure that cannot say which peer is gone
    work = all_gather_into(every, mine.unsqueeze(0), group)
    if not values_travel(group):
        work.wait()
        return None
    t0 = time.monotonic()
    # This rank's arrival mark (one store key per rank, overwritten: its latest exchange) is what names a rank
    # that never arrives. Ranks in step finish the exchange within _MARK_AFTER_S, and then nobody reads marks:
    # the store round trip is spent only on an exchange still waiting by then, or failing.
    store, mark_left = group_store(group), not _done_within(work, _MARK_AFTER_S)
    if mark_left:
        store = _mark(store, rank, n)
    try:
        work.wait(datetime.timedelta(seconds=get_timeout()))
    except Exception as e:
        if not mark_left:  # (failed before its mark: the others may be reading marks now)
            store = _mark(store, rank, n)
        missing = _who_never_arrived(store, n, P, who, early=time.monotonic() - t0 < get_timeout())
        raise RuntimeError(
            f"tokenring: rank {rank} failed to compare {what} with the other ranks within {get_timeout():.0f} s "
            f"({e}).{missing} A rank has died, or is not calling {who} at this point (every rank of the group must "
            f"call it with the same shapes and options). Raise the bound with tokenring.set_timeout() if it is only "
            f"slow. The process group cannot be used again after this: destroy it and start the ranks again."
        ) from e
    return every.tolist()


_MARK_AFTER_S = 0.002  # an exchange not finished by then leaves this rank's arrival mark in the store


def _done_within(work, seconds: float) -> bool:
    """Whether ``work`` completes within ``seconds`` (polled, the CPU left to others meanwhile)."""
    end = time.monotonic() + seconds
    try:
        while not work.is_completed():
            if time.monotonic() >= end:
                return False
            time.sleep(0.0001)
    except Exception:  # a backend whose works cannot say: mark
        return False
    return True


def _mark(store, rank: int, n: int):
    """Leave this rank's arrival at exchange ``n`` in ``store``; the store, or ``None`` when it cannot be reached."""
    if store is None:
        return None
    try:
        store.set(_ARRIVED + str(rank), str(n))
        return store
    except Exception:
        return None


def _arrived(store, rank: int, n: int) -> bool:
    """Whether ``rank`` has reached exchange ``n`` (its mark holds its latest exchange)."""
    key = _ARRIVED + str(rank)
    return bool(store.check([key])) and int(store.get(key)) >= n


def _who_never_arrived(store, n: int, P: int, who: str, early: bool) -> str:
    """A sentence naming the ranks whose arrival mark is short of exchange ``n``. After an early failure (a peer's
    connection closed before the timeout) the others may still be on their way: their marks are awaited up to
    ``_ARRIVAL_WAIT_S``. This rank then counts among the readers (``comm.done_reading``), so that a rank hosting
    the store outlives the others' reading."""
    if store is None:
        return ""
    try:
        deadline = time.monotonic() + (_ARRIVAL_WAIT_S if early else 0.0)
        while True:
            gone = [r for r in range(P) if not _arrived(store, r, n)]
            if len(gone) <= 1 or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        done_reading(store, f"tokenring/arrived/{n}/read", P - 1)
    except Exception:
        return (
            " Which rank never arrived cannot be told: the rendezvous store is gone (its host, rank 0 under a plain "
            "init_process_group, has exited)."
        )
    if not gone:
        return ""
    if len(gone) == 1:
        return (
            f" Rank {gone[0]} is the one that stopped: it never reached this call (it died, hangs, or does not "
            f"call {who} here)."
        )
    return (
        f" Ranks {gone} are the ones that stopped: they never reached this call (they died, hang, or do not call "
        f"{who} here)."
    )


def ranks_differing(values: Sequence[float], group, rank: int, P: int, who: str, what: str) -> list[int]:
    """The ranks whose ``values`` (checksums, shapes) differ from the most common ones, so that the odd rank out
    is named even when it is rank 0; every rank when no values are the most common (two ranks that differ: which
    one is wrong cannot be told). The same list on every rank (empty on the fake process group)."""
    return odd_ones([tuple(row) for row in exchange(values, group, rank, P, who, what) or []])


def odd_ones(rows: Sequence) -> list[int]:
    """The indices of ``rows`` that differ from the most common row; every index when no row is the most common
    (two ranks that differ: which one is wrong cannot be told); empty when all agree."""
    counts = {row: list(rows).count(row) for row in rows}
    usual = [row for row in counts if counts[row] == max(counts.values())]
    if len(usual) > 1:
        return list(range(len(rows)))
    return [r for r, row in enumerate(rows) if row != usual[0]]


def _shown(name: str, value: float) -> str:
    return f"{value:g}"


def differences(
    rows: list[list[float]], names: Sequence[str], rank: int, show: Callable[[str, float], str] = _shown
) -> tuple[int, list[str]] | None:
    """The first rank whose row differs from this rank's in the named fields (the first ``len(names)``), with
    a phrase per field; ``None`` when all agree."""
    here = rows[rank]
    for r, other in enumerate(rows):
        bad = [
            f"{nm} ({show(nm, a)} on rank {r}, {show(nm, b)} on rank {rank})"
            for nm, a, b in zip(names, other, here)
            if a != b
        ]
        if bad:
            return r, bad
    return None


def require_same(
    rows: list[list[float]] | None,
    names: Sequence[str],
    rank: int,
    who: str,
    advice: str,
    show: Callable[[str, float], str] = _shown,
    doing: str = "calls",
) -> None:
    """``ValueError`` (on every rank alike) when any rank's row differs from this one's in the named fields:
    "``who`` (rank 1): rank 0 ``doing`` with a different dtype (...). ``advice``"."""
    if rows is None:
        return
    refused = [r for r, row in enumerate(rows) if row and math.isnan(row[0])]  # (refuse_at_exchange's rows)
    if refused:
        raise ValueError(
            f"{who} (rank {rank}): rank {refused[0]} refused its arguments (its own error says why). {advice}"
        )
    diff = differences(rows, names, rank, show)
    if diff is not None:
        r, bad = diff
        raise ValueError(f"{who} (rank {rank}): rank {r} {doing} with a different {'; '.join(bad)}. {advice}")


def refuse_at_exchange(problem: ValueError, n: int, group, rank: int, P: int, who: str, what: str):
    """Raise ``problem``, this rank's refusal of its arguments, found before an exchange of ``n``-number rows that
    the other ranks make at this point: its row there is all NaN, so :func:`require_same` raises on every rank
    (naming this one) and the group stays in step for the next call."""
    publish_refusal(group, rank, str(problem))
    try:
        exchange([math.nan] * n, group, rank, P, who, what)
    except RuntimeError:  # the others are gone or elsewhere: this rank's own error is the one to raise
        pass
    raise problem


class Verified:
    """``(id(group), signature)`` -> what the agreement decided, for signatures already verified identical on
    every rank. At most ``size`` per group, the oldest dropped first: entries go in only after an exchange
    every rank of the group makes, so every rank keeps the same ones and skips (or repeats) an exchange alike,
    and packed training, with a new mask every step, does not grow it."""

    def __init__(self, size: int = 256):
        self.size, self.groups = size, {}

    def get(self, key):
        return self.groups.get(key[0], {}).get(key)

    def __contains__(self, key) -> bool:
        return key in self.groups.get(key[0], {})

    def __getitem__(self, key):
        return self.groups[key[0]][key]

    def __setitem__(self, key, value) -> None:
        group = self.groups.setdefault(key[0], {})
        group[key] = value
        while len(group) > self.size:
            group.pop(next(iter(group)))

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def clear(self) -> None:
        self.groups.clear()


_caches: list[Verified] = []


def cache(size: int = 256) -> Verified:
    """A :class:`Verified` that :func:`forget_groups` clears."""
    c = Verified(size)
    _caches.append(c)
    return c


def forget_groups() -> None:
    """Forget every group's verified signatures and exchange count (after its process group is destroyed)."""
    for c in _caches:
        c.clear()
    _exchanges.clear()
    marked.clear()
