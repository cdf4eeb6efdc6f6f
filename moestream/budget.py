"""Memory budgets as the user writes them: a byte count or a ratio of all routed-expert bytes. Parsing
needs no torch, so the CLI refuses a bad budget before its heavy imports; what a budget buys in slots is
the store's business (`moestream.store.config`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from moestream.errors import BudgetError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*|%)\s*$")


def format_bytes(num_bytes: int) -> str:
    """A human-readable size in binary units, e.g. '512.0 MiB'."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@dataclass(frozen=True)
class Budget:
    """Exactly one of size_bytes (an absolute size) or ratio (of total routed-expert bytes)."""

    size_bytes: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        if (self.size_bytes is None) == (self.ratio is None):
            raise BudgetError("a budget is either a byte count or a ratio, not both or neither")
        if self.size_bytes is not None and self.size_bytes < 0:
            raise BudgetError(f"a budget cannot be negative, got {self.size_bytes} bytes")
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise BudgetError(f"a budget ratio must be in [0, 1], got {self.ratio}")

    @classmethod
    def parse(cls, text: "str | int | float | Budget", flag: str = "budget", ratios: bool = True) -> "Budget":
        """'0.25', '1.0' or '25%' (ratio), '512MiB', '1GB', '4096B' (sizes). A bare integer other than 0 is
        refused: '1' could mean one byte or everything. A Python int is bytes and a float a ratio (their
        type says which). `flag` names the setting in every refusal; ratios=False: a flag that takes only
        a size (a ratio is refused, and the messages suggest sizes only)."""
        if isinstance(text, Budget):
            return text
        if isinstance(text, int) and not isinstance(text, bool):
            return cls(size_bytes=text)
        sizes = "a size like 512MiB"
        number, unit = _split(text, flag, f"a ratio like 0.25 or 25%, or {sizes}" if ratios else sizes)
        if unit == "%" or (not unit and "." in number):
            if not ratios:
                raise BudgetError(f"{flag}: takes {sizes}, not a ratio ({text!r})")
            ratio = float(number) / (100 if unit == "%" else 1)
            if ratio > 1:
                raise BudgetError(f"{flag}: {text!r} is more than all the experts: a ratio is at most 1.0 (100%)")
            return cls(ratio=ratio)
        if not unit and float(number) != 0:
            ratio = "a ratio (1.0 or 100% for all experts) or " if ratios else ""
            raise BudgetError(f"{flag}: {text!r} has no unit: write {ratio}a size ({number}B, 512MiB)")
        return cls(size_bytes=_bytes(number, unit, text, flag))

    def resolve(self, total_bytes: int) -> int:
        """The budget in bytes, given the model's total routed-expert bytes."""
        return self.size_bytes if self.size_bytes is not None else int(round(total_bytes * self.ratio))

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else format_bytes(self.size_bytes)

    def percent(self, total_bytes: int) -> str:
        """The budget as a percentage of the model's total routed-expert bytes, e.g. '25%'."""
        share = 100 * self.resolve(total_bytes) / total_bytes if total_bytes else 0.0
        return f"{share:.3g}%"


def parse_size(text: "str | int", flag: str) -> int:
    """A byte count such as '256KiB' or '1048576' (a bare integer is bytes); ratios are refused."""
    number, unit = _split(text, flag, "a size such as 256KiB or a byte count")
    if unit == "%" or (not unit and "." in number):
        raise BudgetError(f"{flag} takes a size such as 256KiB, not a ratio ({text!r})")
    return _bytes(number, unit, text, flag)


def _split(text, flag: str, expected: str) -> tuple[str, str]:
    """(number, lower-case unit or '%') of a budget or size, or one line naming the flag."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    match = _BUDGET.match(text) if isinstance(text, str) else None
    if match is None:
        raise BudgetError(f"{flag}: cannot read {text!r}: use {expected}")
    return match.group(1), match.group(2).lower()


def _bytes(number: str, unit: str, text, flag: str) -> int:
    if unit not in _UNITS:
        known = ", ".join(u for u in _UNITS if u)
        raise BudgetError(f"{flag}: unknown size unit in {text!r}; known: {known}")
    return int(float(number) * _UNITS[unit])
