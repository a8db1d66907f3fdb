"""``tokenring`` command line: ``tokenring <command> [options]``; each command lives in its own module."""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "demo": (
        "tokenring.tools.demo",
        "4 local ranks prefill a long prompt through a Llama-style model with every strategy, checked",
    ),
    "bench": ("tokenring.tools.bench", "side-by-side benchmark of strategies (and PyTorch's own) on local ranks"),
    "testbed": ("tokenring.tools.testbed", "run the benchmark over emulated, bandwidth-shaped links (root)"),
    "simulate": ("tokenring.tools.simulate", "predict each strategy's time on a modelled interconnect"),
    "calibrate": ("tokenring.tools.calibrate", "measure this machine's kernels and links into a profile for auto"),
    "explain": ("tokenring.tools.explain", "what auto would pick and why, or (--plan) a strategy's schedule per rank"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
        print("usage: tokenring <command> [options]\n\ncommands:\n" + "\n".join(lines))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
