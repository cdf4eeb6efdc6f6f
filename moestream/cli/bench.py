"""`moestream bench KIND`: benchmarks that print figures. Each module of moestream.bench adds a KIND, but
its `tools` package: what the benches and `moestream sim` and `loadgen` measure with."""

from __future__ import annotations

import importlib
import pkgutil

import moestream.bench

TOOLS = "tools"


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="run a benchmark and print its figures")
    kinds = parser.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    for info in sorted(pkgutil.iter_modules(moestream.bench.__path__), key=lambda i: i.name):
        if info.name != TOOLS:
            importlib.import_module(f"moestream.bench.{info.name}").add_parser(kinds)
