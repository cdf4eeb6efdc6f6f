"""Benchmarks behind `moestream bench`: each module defines add_parser(kinds) for one KIND."""
