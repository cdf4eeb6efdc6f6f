"""`moestream sim`: replay a routing trace through policies in the simulator (the lab's command)."""

from moestream.bench.commands.sim import add_parser

__all__ = ["add_parser"]
