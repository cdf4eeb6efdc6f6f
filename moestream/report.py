"""The console the CLI prints its tables on: rich's, on stdout, and wide enough for whole figures where stdout is a
file or a pipe (rich would cut cells at 80 columns there); a table of text rows and a cell's text. Knows no figures."""

from __future__ import annotations

import sys


def report_console(width: int):
    """A rich Console on stdout; at least `width` columns where stdout is not a terminal."""
    from rich.console import Console

    console = Console()
    if not sys.stdout.isatty():  # not console.is_terminal: FORCE_COLOR makes a pipe a terminal to rich
        console.width = max(console.width, width)
    return console


def rich_table(title: str, columns, rows, left: tuple[str, ...] = (), no_wrap: bool = False, **options):
    """A rich Table of text rows: the `left` columns (else the first) left-justified, the others right."""
    from rich.table import Table

    table = Table(title=title, **options)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if column in left or not (left or i) else "right", no_wrap=no_wrap)
    for row in rows:
        table.add_row(*row)
    return table


def fmt(value, pattern) -> str:
    """The value in pattern (a format string, or a function of the value), "-" for None."""
    if value is None:
        return "-"
    return pattern(value) if callable(pattern) else pattern.format(value)
