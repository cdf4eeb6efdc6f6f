"""Seeded synthetic traces for tests (moestream.sim.synthetic makes them). Real results use real traces."""

from moestream.sim.synthetic import synthetic_trace

__all__ = ["synthetic_trace"]
