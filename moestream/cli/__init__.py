"""The `moestream` command. Each module in this package adds one subcommand through add_parser().

Every subcommand's handler is `args.handler(args) -> int`. User errors (MoestreamError) become one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from moestream.errors import MoestreamError

DESCRIPTION = "Serve Mixture-of-Experts models whose experts live on disk and in host memory."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestream", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        importlib.import_module(f"{__name__}.{info.name}").add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.handler(args) or 0)
    except MoestreamError as error:
        print(f"moestream: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
