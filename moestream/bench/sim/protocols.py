"""Named evaluation protocols and `simulate`, the one entry point that runs a policy on a trace.

A protocol turns (policy, trace, config) into a metrics dict. `stream` is the discrete-event
simulator (`engine.py`), `moe-beyond` the MoE-Beyond study's hit-rate protocol (`moe_beyond.py`).
This module knows the policy contract, never a policy by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterator

from moestream.bench.sim import replay
from moestream.bench.sim.config import SimConfig
from moestream.contracts import Policy
from moestream.errors import MoestreamError
from moestream.registry import Registry
from moestream.trace.replay import Iteration
from moestream.trace.schema import Trace


class SimulationError(MoestreamError):
    """A policy and a trace that cannot be simulated together."""


class Protocol(ABC):
    @abstractmethod
    def run(self, policy: Policy, trace: Trace, config: SimConfig) -> dict:
        """Replay trace through policy; the metrics, with hit_rate in [0, 1]."""


PROTOCOLS: Registry[Protocol] = Registry("protocol")

REPLAYS: dict[str, Callable[[Trace, SimConfig], Iterator[Iteration]]] = {
    "decode": lambda trace, config: replay.decode_stream(trace),
    "prefill": lambda trace, config: replay.prefill(trace),
    "batched": lambda trace, config: replay.batched_decode(trace, config.batch_size),
}


def check_compatible(policy: Policy, trace: Trace) -> None:
    """The trace has the policy's topology and every field the policy needs."""
    mine, theirs = policy.topology, trace.topology
    if not mine.routes_like(theirs):
        raise SimulationError(
            f"trace topology ({theirs.routing_shape()}) differs from the policy's ({mine.routing_shape()})"
        )
    missing = [name for name in policy.trace_needs if getattr(trace, name, None) is None]
    if missing:
        raise SimulationError(
            f"policy {policy.registry_name!r} needs trace field(s) {', '.join(missing)}, "
            f"which {trace.source or 'the trace'} does not have"
        )


def simulate(policy: Policy, trace: Trace, config: SimConfig, protocol: str = "stream") -> dict:
    """Run an already fitted policy over trace under a named protocol; its metrics."""
    runner = PROTOCOLS.create(protocol)
    check_compatible(policy, trace)
    policy.prepare(trace)
    return runner.run(policy, trace, config)
