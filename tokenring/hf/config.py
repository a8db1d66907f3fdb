"""The settings every tokenring.hf layer reads (strategy, layout, group), and the active
:class:`~tokenring.hf.training.SequenceParallel`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..agreement import checksum, ranks_differing
from ..layouts import check_layout, group_info
from ..strategies import get as get_strategy
from ..strategies import node_size

__all__ = ["NAME", "IGNORE_INDEX", "configure", "settings", "active", "same_batch"]


NAME = "tokenring"

IGNORE_INDEX = -100


@dataclass
class _Settings:
    strategy: str = "auto"
    layout: str = "zigzag"
    group: object = None
    check_positions: bool = True
    inner_size: int | None = None  # ranks per node for the hierarchical strategies (None: $LOCAL_WORLD_SIZE)
    config_fn: object = None  # private: module -> tokenring.instrument() fields for its call (tracing), or None


_settings = _Settings()


def configure(
    strategy: str | None = None,
    layout: str | None = None,
    group=None,
    check_positions: bool | None = None,
    inner_size: int | None = None,
) -> None:
    """Set the strategy (``"auto"``, ``"token_ring"``, ``"ring"``, ``"ulysses"``, ``"ring_bidir"`` or a variant
    such as ``"token_ring:direct,c=2,k=3"``), the layout the inputs were
    sharded with (``"zigzag"`` default, or ``"contiguous"``) and the process group used by every attention
    layer of models with ``attn_implementation="tokenring"``; ``inner_size``: ranks per node for the
    hierarchical strategies (``"usp"``, ``"double_ring"``, ``"token_ring_2d"``; default ``$LOCAL_WORLD_SIZE``).
    Arguments left ``None`` keep their value."""
    # Every argument is checked before any is set: a refused call (say a good strategy with a bad layout)
    # leaves the settings as they were, not half changed.
    if inner_size is not None:
        node_size(inner_size)  # a positive number of ranks per node, or a ValueError saying so
    if strategy is not None and strategy != "auto":
        get_strategy(strategy)  # unknown names and malformed variants fail here, with what is accepted
    if layout is not None:
        check_layout(layout, auto=True)
    if strategy is not None:
        _settings.strategy = strategy
    if layout is not None:
        _settings.layout = layout
    if group is not None:
        _settings.group = group
    if check_positions is not None:
        _settings.check_positions = bool(check_positions)
    if inner_size is not None:
        _settings.inner_size = int(inner_size)


@contextlib.contextmanager
def settings(**kw):
    """``with tokenring.hf.settings(strategy="ring"): model(...)`` — :func:`configure` for a block only."""
    old = _Settings(**vars(_settings))
    try:
        configure(**kw)
        yield _settings
    finally:
        _settings.__dict__.update(vars(old))


_active = None  # the active tokenring.hf.SequenceParallel


def restore(group, layout: str) -> None:
    """Put the layers' group and layout back as they were (what :class:`SequenceParallel` set, undone)."""
    _settings.group, _settings.layout = group, layout


def active():
    """The :class:`SequenceParallel` the tokenring.hf layers run under, if any."""
    return _active


def set_active(sp) -> None:
    """Make ``sp`` (a :class:`tokenring.hf.training.SequenceParallel`, or ``None``) the active configuration."""
    global _active
    _active = sp


def same_batch(group, tensors: list) -> None:
    """ValueError on every rank of ``group`` unless all hold the same ``tensors`` (a checksum each, gathered)."""
    rank, P = group_info(group)
    if P == 1:
        return
    values = [checksum(t) for t in tensors] + [len(tensors)]
    differ = ranks_differing(values, group, rank, P, "tokenring.hf", "batches")
    if differ:
        raise ValueError(
            f"tokenring: the ranks of one sequence-parallel group hold different samples (ranks "
            f"{differ} differ from the rest; every rank named where none is the most common); they must all get "
            f"the same full sequences, which each "
            f"shards. The data loader is the likely cause: it must be sharded over the data-parallel "
            f"ranks only (a DistributedSampler over dp, or tokenring.hf.SequenceParallelTrainer), "
            f"not over every rank"
        )
