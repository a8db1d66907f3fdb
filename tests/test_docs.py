"""The README's support matrix and module maps (README and docs/DESIGN.md) name every registered strategy;
the README stays a first page."""

import os
import re

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


def recipe_diff(name: str) -> str:
    """The changed lines from examples/recipes/stock/``name`` to examples/recipes/``name`` ("-"/"+" lines)."""
    import difflib

    stock = _read("examples", "recipes", "stock", name).splitlines()
    ours = _read("examples", "recipes", name).splitlines()
    return "\n".join(d[0] + d[2:] for d in difflib.ndiff(stock, ours) if d[:2] in ("- ", "+ ") and d[2:].strip())


def test_readme_recipe_diffs_are_the_files_diffs():
    """The README's training and generation diffs are the recipes' real diffs, each adding at most 5 lines."""
    readme = _read("README.md")
    for name in ("trainer.py", "trl_grpo.py", "plain_loop.py", "generate.py"):  # (trl_sft.py: like trl_grpo.py)
        diff = recipe_diff(name)
        assert f"```diff\n{diff}\n```" in readme, name
        assert sum(line.startswith("+") for line in diff.splitlines()) <= 5, name


def test_readme_is_a_first_page():
    """At most 250 lines, and at most 30 numbers (digit runs such as 16K, 2.13.0, 0.89x) in its first 40 lines:
    details belong in docs/."""
    lines = _read("README.md").splitlines()
    assert len(lines) <= 250, len(lines)
    numbers = re.findall(r"\d+(?:\.\d+)*", "\n".join(lines[:40]))
    assert len(numbers) <= 30, numbers
