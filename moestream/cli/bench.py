"""`moestream bench KIND`: benchmarks that print figures. Each module of moestream.bench adds a KIND, but
its packages `tools` (what the benches measure with), `sim` (the simulator) and `commands` (the lab's
own commands)."""

from __future__ import annotations

import importlib
import pkgutil

import moestream.bench

NOT_KINDS = ("tools", "sim", "commands")


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="run a benchmark and print its figures")
    kinds = parser.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    for info in sorted(pkgutil.iter_modules(moestream.bench.__path__), key=lambda i: i.name):
        if info.name not in NOT_KINDS:
            importlib.import_module(f"moestream.bench.{info.name}").add_parser(kinds)
