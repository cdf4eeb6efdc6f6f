"""Progress bars that stay plain where output is not a terminal.

On a terminal, `progress_bar(...)` is a tqdm bar redrawn in place. Elsewhere (a log file, a CI job, a
pipe) it writes whole lines, at most one every `PLAIN_INTERVAL_S` seconds, with no carriage
returns or cursor escapes. This module knows nothing of what is being counted.
"""

from __future__ import annotations

import os
import re
import sys

from tqdm.auto import tqdm

PLAIN_INTERVAL_S = 10.0
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class LineWriter:
    """A file for tqdm that turns each redraw into one plain line (blank redraws dropped)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        for part in _ESCAPES.sub("", text).replace("\r", "\n").split("\n"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:  # tqdm's disable=None (hide where not a terminal) asks
        return False


def progress_bar(iterable=None, *, stream=None, **options) -> tqdm:
    """A tqdm bar (same options) on stderr, plain lines when stderr is not a terminal."""
    stream = stream or sys.stderr
    if not stream.isatty():
        options = {"mininterval": PLAIN_INTERVAL_S, "ascii": True, "dynamic_ncols": False, "ncols": 80} | options
        stream = LineWriter(stream)
    return tqdm(iterable, file=stream, **options)


class DeferredBar:
    """A progress_bar drawn only once its total is known, for work that learns its size first: start(total)
    opens it, update(n) advances it; as a context manager it closes at the end. Never started, it draws
    nothing (no size-less '0.00B' line before the work, or before a refusal)."""

    def __init__(self, **options):
        self.options, self.bar = options, None

    def start(self, total: int) -> None:
        self.close()
        self.bar = progress_bar(total=total, **self.options)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "DeferredBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plain_foreign_bars() -> None:
    """Where stderr is not a terminal, turn off transformers' and huggingface_hub's own bars ('Loading
    weights', 'Writing model shards'), which would draw with cursor escapes. Call before they are
    imported (a CLI's start); a value the user set is kept."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
