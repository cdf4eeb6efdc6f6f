"""The console the CLI prints its tables on: rich's, on stdout, and wide enough for whole figures
where stdout is a file or a pipe (rich would cut cells at 80 columns there). Knows no figures."""

from __future__ import annotations

import sys


def report_console(width: int):
    """A rich Console on stdout; at least `width` columns where stdout is not a terminal."""
    from rich.console import Console

    console = Console()
    if not sys.stdout.isatty():  # not console.is_terminal: FORCE_COLOR makes a pipe a terminal to rich
        console.width = max(console.width, width)
    return console
