"""The README's support matrix and module maps (README and docs/DESIGN.md) name every registered strategy."""

import os

from tokenring.strategies import _MODULES, FAMILIES

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def test_every_strategy_in_the_readme_matrix():
    rows = [line for line in _read("README.md").splitlines() if line.startswith("| `")]
    named = {line.split("`")[1] for line in rows}
    assert set(FAMILIES) <= named, set(FAMILIES) - named


def test_every_strategy_module_in_the_module_maps():
    files = {m.__name__.rsplit(".", 1)[1] + ".py" for m in _MODULES}
    for doc in (_read("README.md"), _read("docs", "DESIGN.md")):
        missing = {f for f in files if f not in doc}
        assert not missing, missing
