"""Rank-side wrapper for tests/test_examples.py: runs an example's rank function from examples/ in a pool."""

from __future__ import annotations

import importlib
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")


def run_example(rank: int, P: int, module: str, fn: str, *args):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return getattr(importlib.import_module(module), fn)(rank, P, *args)
