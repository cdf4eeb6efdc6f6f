"""`moestream loadgen`: replay an arrival trace against a local server (the lab's command)."""

from moestream.bench.commands.loadgen import add_parser

__all__ = ["add_parser"]
