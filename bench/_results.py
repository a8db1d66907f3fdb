"""What the bench scripts share: writing a result as JSON + a Markdown table, and reading earlier measurements
or checking that the testbed can measure new ones."""

from __future__ import annotations

import json
import os


def write(stem: str, data: dict, lines: list[str]) -> None:
    """``stem.json`` (everything measured) and ``stem.md`` (the table), and print the table."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def measurements(from_json: str | None, who: str) -> tuple[list | None, bool]:
    """``(earlier measurements or None, can proceed)``: the ``measurements`` of ``from_json`` when given;
    otherwise ``(None, True)`` if the testbed can run here, ``(None, False)`` after saying why not."""
    if from_json:
        with open(from_json) as f:
            return json.load(f)["measurements"], True
    from tokenring.tools.testbed import available

    why = available()
    if why:
        print(f"{who}: cannot measure: {why}. Use --from-json with earlier measurements.")
        return None, False
    return None, True
