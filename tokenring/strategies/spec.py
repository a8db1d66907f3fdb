"""A strategy spec as a value: :meth:`Spec.parse`, :meth:`Spec.text` (canonical), :meth:`Spec.code` (the numbers
of the cross-rank signature). Grammar ``family[:mode][,c=C][,k=K][,n=N][,keep][,o=O]``: docs/schedules.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Spec", "MODES", "CODE_LEN"]

MODES = ("", "auto", "relay", "direct")
_KEYS = {"c": "chunks", "k": "lookahead", "n": "inner", "o": "outer"}


@dataclass(frozen=True)
class Spec:
    family: str
    mode: str = ""  # "" = the family's default mode
    chunks: int = 1
    lookahead: int = 1
    inner: int = 0  # ranks per node (0: flat, or not known yet)
    keep: bool = False
    outer: int = 1

    @classmethod
    def parse(cls, text: str) -> "Spec":
        """``text`` as a spec; ``ValueError`` naming the grammar if it is not one (the family is not checked)."""
        family, _, params = str(text).partition(":")
        if not params:
            return cls(family)
        items = params.split(",")
        mode = "" if "=" in items[0] or items[0] == "keep" else items.pop(0)
        if mode not in MODES:
            raise ValueError(f"strategy={text!r}: unknown mode {mode!r}; modes are relay, direct and auto")
        args: dict = {}
        for item in items:
            key, _, value = item.partition("=")
            if item == "keep":
                args["keep"] = True
            elif key in _KEYS and value.isdigit():
                args[_KEYS[key]] = int(value)
            else:
                raise ValueError(
                    f"strategy={text!r}: parameters are c=<chunks>, k=<lookahead blocks> and, for the "
                    f"hierarchical strategies, n=<ranks per node>, keep and o=<outer chunks>; e.g. "
                    f"'{family}:direct,c=2,k=1'"
                )
        return cls(family, mode, **args)

    def given(self) -> list[str]:
        """The fields set away from their defaults (the family aside)."""
        return [f.name for f in fields(self) if f.name != "family" and getattr(self, f.name) != f.default]

    def text(self, default_mode: str = "") -> str:
        """The canonical spec: no mode when it is ``default_mode``; ``c``/``k`` for a direct schedule only."""
        head = self.family if self.mode in ("", default_mode) else f"{self.family}:{self.mode}"
        params = [f"c={self.chunks}", f"k={self.lookahead}"] if self.mode == "direct" else []
        params += (
            [f"n={self.inner}"] * bool(self.inner) + ["keep"] * self.keep + [f"o={self.outer}"] * (self.outer != 1)
        )
        return head + (("," if ":" in head else ":") + ",".join(params) if params else "")

    def code(self, families: tuple[str, ...]) -> list[float]:
        """Seven numbers (family, mode, chunks, lookahead, ranks per node, keep, outer chunks)."""
        return [
            float(families.index(self.family)),
            float(MODES.index(self.mode)),
            float(self.chunks),
            float(self.lookahead),
            float(self.inner),
            float(self.keep),
            float(self.outer),
        ]

    @classmethod
    def from_code(cls, values, families: tuple[str, ...]) -> "Spec":
        fam, mode, c, k, n, keep, outer = (int(x) for x in values)
        return cls(families[fam], MODES[mode], c, k, n, bool(keep), outer)


CODE_LEN = len(fields(Spec))
