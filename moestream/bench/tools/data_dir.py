"""Where the real data (routing traces, prompt sets, arrival traces) lies, whatever the working directory: an
explicit `--data-dir`, then `$MOESTREAM_DATA`, then `shared/data` beside the checkout that holds this package (a
development install), then `../shared/data` from the working directory. Reads no data and knows no format."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV = "MOESTREAM_DATA"
_CHECKOUT = Path(__file__).resolve().parents[3]  # moestream/bench/tools/ -> the checkout


@dataclass(frozen=True)
class DataDir:
    path: Path
    source: str  # how it was chosen, for the line that says so

    def describe(self) -> str:
        found = "" if self.path.is_dir() else ", absent"
        return f"data: {self.path} ({self.source}{found})"


def resolve_data_dir(explicit: Path | None = None) -> DataDir:
    """The data directory to use (see the module's order); the last candidate when none exists."""
    if explicit is not None:
        return DataDir(explicit, "--data-dir")
    candidates = [(Path(p), f"${ENV}") for p in [os.environ.get(ENV)] if p]
    candidates += [(_CHECKOUT.parent / "shared" / "data", "beside the moestream checkout"),
                   (Path.cwd().parent / "shared" / "data", "../shared/data from the working directory")]
    for path, source in candidates[:-1]:
        if path.is_dir() or source.startswith("$"):
            return DataDir(path, source)
    return DataDir(*candidates[-1])
