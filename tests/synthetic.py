"""Seeded synthetic traces for tests (moestream.bench.sim.synthetic makes them). Real results use real traces."""

from moestream.bench.sim.synthetic import synthetic_trace

__all__ = ["synthetic_trace"]
