#!/usr/bin/env python3
"""Legibility figures of the core (``tokenring/`` less ``tools/``) at this checkout and at an older commit: lines,
the share of docstring and comment lines, the longest functions, import cycles, import time and per-call overhead
at P=4 (forward and forward+backward at a tiny shape, local gloo ranks, every call kept, rounds interleaved
between the two checkouts). Writes ``bench/results/code_stats.json``:

    .venv/bin/python bench/code_stats.py [--base 1915c8f] [--calls 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import tokenize
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _prose_lines(src: str) -> set[int]:
    """Line numbers holding a docstring or a comment."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def static(root: str) -> dict:
    files, total, prose, funcs = 0, 0, 0, []
    core = os.path.join(root, "tokenring")
    for dirpath, _, names in os.walk(core):
        if os.path.relpath(dirpath, core).startswith("tools"):
            continue
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            src = open(path).read()
            code = [i + 1 for i, line in enumerate(src.splitlines()) if line.strip()]
            files, total = files + 1, total + len(code)
            prose += len(_prose_lines(src) & set(code))
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    funcs.append((node.end_lineno - node.lineno + 1, f"{os.path.relpath(path, root)}:{node.name}"))
    funcs.sort(reverse=True)
    return dict(
        files=files,
        nonblank_lines=total,
        prose_lines=prose,
        prose_share=prose / total,
        longest_functions=funcs[:8],
        functions_over_60=[f for f in funcs if f[0] > 60],
        api_lines=len(open(os.path.join(core, "api.py")).read().splitlines()),
        **structure(root),
    )


def structure(root: str) -> dict:
    """Import cycles, function-local package imports, and where checksums and all-gathers are written (the
    cross-rank agreement: ``zlib.crc32`` outside agreement.py is a second copy of its checksum)."""
    sys.path.insert(0, ROOT)
    from tokenring.tools.layers import cycles, imports, local_imports, modules

    mods = modules(os.path.join(root, "tokenring"))
    core = {m: p for m, p in mods.items() if not m.startswith("tools")}
    crc = {m: open(p).read().count("zlib.crc32") for m, p in core.items()}
    gathers = {m: open(p).read().count("dist.all_gather(") for m, p in core.items()}
    return dict(
        import_cycles=cycles(imports(mods)),
        local_package_imports=local_imports(core),
        crc32_sites={m: n for m, n in crc.items() if n},
        all_gather_sites={m: n for m, n in gathers.items() if n},
    )


PROBE = (
    "import json, time; import torch; t = time.perf_counter(); import tokenring; "
    "print(json.dumps((time.perf_counter() - t) * 1e3))"
)


def overhead(rank: int, P: int, calls: int) -> dict:
    """Milliseconds per call on this rank: forward alone (no grad) and forward+backward, interleaved."""
    import time

    import torch

    import tokenring

    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 16, 4, 16, requires_grad=True) for _ in range(3))
    kw = dict(causal=True, strategy="token_ring:direct,c=1,k=1")
    qd, kd = torch.randn(1, 1, 4, 16), torch.randn(1, 16, 4, 16)  # a decode step: 1 token, 16 cached rows here
    qe, ke = torch.randn(1, 4, 4, 16), torch.randn(1, 20, 4, 16)  # an extend turn: 4 new tokens per rank
    calls_of = {
        "fwd": lambda: _no_grad(lambda: tokenring.attention(q, k, v, **kw)),
        "fwdbwd": lambda: tokenring.attention(q, k, v, **kw).sum().backward(),
        "decode": lambda: tokenring.decode_attention(qd, kd, kd),
        "extend": lambda: tokenring.extend_attention(qe, ke, ke, new=(4 * rank, 4 * rank + 4), strategy="pass_q"),
    }
    times = {kind: [] for kind in calls_of}
    for i in range(calls + 5):
        for kind, call in calls_of.items():
            t = time.perf_counter()
            call()
            if i >= 5:
                times[kind].append((time.perf_counter() - t) * 1e3)
    return times


def _no_grad(fn):
    import torch

    with torch.no_grad():
        return fn()


def per_call(root: str, calls: int) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {root!r}); sys.path.insert(1, {HERE!r})\n"
        f"from code_stats import overhead\nfrom tokenring.tools.launch import spawn\n"
        f"if __name__ == '__main__':\n    print(json.dumps(spawn(overhead, 4, {calls})[0]))\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        out = subprocess.run(
            [sys.executable, f.name],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
            env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"),
        ).stdout
    finally:
        os.unlink(f.name)
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="1915c8f")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    res = dict(
        command="python bench/code_stats.py",
        base=a.base,
        machine=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        shape="B=1 s=16/rank H=4 d=16 fp32 causal, token_ring:direct,c=1,k=1, P=4 gloo; forward (no grad) and "
        "forward+backward; decode_attention of 1 token over 16 cached rows per rank; extend_attention pass_q of 4 "
        "new tokens per rank over 16 cached rows per rank; interleaved",
    )
    with tempfile.TemporaryDirectory() as old:
        subprocess.run(f"git -C {ROOT} archive {a.base} tokenring | tar -x -C {old}", shell=True, check=True)
        roots = {"before": old, "after": ROOT}
        for label, root in roots.items():
            res[label] = static(root)
        imports = {k: [] for k in roots}
        calls = {k: {} for k in roots}
        for _ in range(a.rounds):  # interleaved
            for label, root in roots.items():
                imports[label] += [
                    json.loads(
                        subprocess.run(
                            [sys.executable, "-c", PROBE],
                            cwd=root,
                            text=True,
                            capture_output=True,
                            check=True,
                            env=dict(os.environ, PYTHONPATH=root),
                        ).stdout
                    )
                    for _ in range(3)
                ]
                got = per_call(root, a.calls)
                for kind in got:
                    calls[label].setdefault(kind, []).extend(got[kind])
        for label in roots:
            res[label].update(
                import_ms=imports[label],
                import_median_ms=median(imports[label]),
                call_ms=calls[label],
                call_median_ms={kind: median(x) for kind, x in calls[label].items()},
                call_ms_quartiles={
                    kind: [sorted(x)[len(x) // 4], sorted(x)[3 * len(x) // 4]] for kind, x in calls[label].items()
                },
            )
    res["after_over_before"] = {
        kind: res["after"]["call_median_ms"][kind] / res["before"]["call_median_ms"][kind]
        for kind in ("fwd", "fwdbwd", "decode", "extend")
    }
    with open(os.path.join(HERE, "results", "code_stats.json"), "w") as f:
        json.dump(res, f, indent=1)
    for label in ("before", "after"):
        r = res[label]
        print(
            f"{label:>6}: {r['nonblank_lines']} lines, prose {r['prose_share']:.1%}, longest "
            f"{r['longest_functions'][0]}, {len(r['functions_over_60'])} functions over 60 lines, api.py "
            f"{r['api_lines']} lines, {len(r['import_cycles'])} import cycles, {len(r['local_package_imports'])} "
            f"function-local package imports, crc32 in {sorted(r['crc32_sites'])}, import "
            f"{r['import_median_ms']:.0f} ms, call fwd {r['call_median_ms']['fwd']:.2f} ms, fwd+bwd "
            f"{r['call_median_ms']['fwdbwd']:.2f} ms, decode {r['call_median_ms']['decode']:.2f} ms, extend "
            f"{r['call_median_ms']['extend']:.2f} ms"
        )
    print("per-call median, after / before: " + ", ".join(f"{k} {v:.3f}" for k, v in res["after_over_before"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
