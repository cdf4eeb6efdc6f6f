"""Progress bars that stay plain where output is not a terminal: a tqdm bar redrawn in place on a terminal,
else whole lines, at most one every `PLAIN_INTERVAL_S` seconds, without carriage returns or cursor escapes
(a log file, a CI job, a pipe). Knows nothing of what is being counted."""

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
    """A progress_bar drawn only once start(total) gives its total; update(n) advances it; closes at a with-block's end.
    Never started, it draws nothing (no size-less '0.00B' line before the work, or before a refusal)."""

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
    """Where stderr is not a terminal, turns off transformers' and huggingface_hub's own bars (cursor escapes); call
    before they are imported. A value the user set is kept."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
