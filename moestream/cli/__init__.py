"""The `moestream` command. Each module in this package adds one subcommand through add_parser().

Only the module of the command being run is imported (all of them for help or an unknown command), so
argument errors come back before other commands' heavy imports. Every handler is `args.handler(args) ->
int`. User errors (MoestreamError) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from moestream import __version__
from moestream.errors import MoestreamError
from moestream.progress import plain_foreign_bars


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that shows an option's default where it has one and its text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if (not action.option_strings or "default" in text or text == argparse.SUPPRESS
                or default is None or isinstance(default, bool) or default is argparse.SUPPRESS or default == []):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse's parser whose help (and subcommands') shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with every subcommand, or only the one argv names."""
    parser = Parser(prog="moestream", description="Serve Mixture-of-Experts models whose experts live on disk and in "
                                                  "host memory.")
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _command_modules(argv):
        importlib.import_module(f"{__name__}.{name}").add_parser(commands)
    return parser


def _command_modules(argv: list[str] | None) -> list[str]:
    names = sorted(info.name for info in pkgutil.iter_modules(__path__))
    if argv is not None and "--version" in argv:
        return []
    command = next((arg for arg in argv or [] if not arg.startswith("-")), None)
    module = command.replace("-", "_") if command else None
    return [module] if module in names else names


def _run(args) -> int:
    """The command; under torchrun, a command that runs on ranks (generate, serve) runs on every rank."""
    from moestream.parallel.ranks import launched

    if getattr(args, "runs_on_ranks", False) and launched():
        from moestream.parallel.launch import run_ranks

        return run_ranks(args)
    return int(args.handler(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    plain_foreign_bars()
    try:
        return _run(args)
    except MoestreamError as error:
        print(f"moestream: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moestream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
