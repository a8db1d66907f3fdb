"""The package's import structure: layers that only import downwards, and no import cycle, counting the imports
inside functions too (a function-local import that breaks a cycle still is one). Read by tests/test_layers.py
and bench/code_stats.py.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module may import its own layer or lower ones; a package's ``__init__`` is its name.
LAYERS = [
    ("base", ["settings", "device", "data"]),
    ("blocks", ["kernels", "merge", "masks", "layouts", "messages"]),
    ("engine", ["schedules", "comm", "executor", "program", "instrument", "agreement"]),
    ("strategies", ["strategies", "single"]),
    ("choice", ["sim", "choice"]),
    ("ops", ["ops", "api", "decode", "extend"]),
    ("front", ["calibration", "context", ""]),
    ("integrations", ["hf", "mixers", "mixer_op", "recurrence", "loss"]),
    ("tools", ["tools", "testing", "__main__"]),
]


def modules(root: str = ROOT) -> dict[str, str]:
    """Dotted name (without ``tokenring.``) -> path, for the package at ``root``."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
                out[rel.removesuffix("__init__").rstrip(".")] = os.path.join(dirpath, name)
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".") if package else []
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                    base = "tokenring" + ("." + base if base else "")
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" for a in node.names]  # a module, or a name in module ``base``
            else:
                continue
            for name in names:
                if name != "tokenring" and not name.startswith("tokenring."):
                    continue
                name = name.removeprefix("tokenring").lstrip(".")
                while name not in mods:
                    name = name.rpartition(".")[0]
                if name != mod:
                    targets.add(name)
        graph[mod] = targets
    return graph


def layer(mod: str) -> int:
    top = mod.split(".")[0]
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"tokenring.{mod} is in no layer of tokenring/tools/layers.py: add it")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"tokenring.{a} ({LAYERS[layer(a)][0]}) imports tokenring.{b} ({LAYERS[layer(b)][0]})"
        for a, targets in graph.items()
        for b in targets
        if layer(b) > layer(a)
    )


def local_imports(mods: dict[str, str]) -> list[str]:
    """Imports of package modules inside functions: ``module:line -> target``."""
    out = []
    for mod, path in mods.items():
        tree = ast.parse(open(path).read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tokenring")):
                    out.append(f"{mod}:{node.lineno} -> {'.' * node.level}{node.module or ''}")
    return sorted(set(out))


if __name__ == "__main__":
    g = imports(modules())
    for c in cycles(g):
        print("cycle:", c)
    for u in upward(g):
        print(u)
