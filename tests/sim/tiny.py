"""Hand-made traces and cost models whose simulated counts can be worked out by hand."""

from __future__ import annotations

import numpy as np

from moestream.bench.sim.cost import CostModel
from moestream.contracts import Policy, Prediction, Predictor
from moestream.topology import Topology
from moestream.trace.schema import Trace

MB = 1_000_000


def topology(num_layers: int = 2, num_experts: int = 4, top_k: int = 1) -> Topology:
    return Topology(moe_layer_ids=tuple(range(1, num_layers + 1)), num_experts=num_experts, top_k=top_k, expert_bytes=MB)


def trace(sequences: list[list[list[list[int]]]], topo: Topology) -> Trace:
    """sequences[s][t][l] = the experts token t of sequence s routes to at layer l."""
    experts = np.array([token for seq in sequences for token in seq], dtype=np.int16)  # [N, L, K]
    seq_ids = np.concatenate([np.full(len(seq), s) for s, seq in enumerate(sequences)]).astype(np.int32)
    positions = np.concatenate([np.arange(len(seq)) for seq in sequences]).astype(np.int32)
    return Trace(topo, experts, seq_ids, positions, np.zeros(len(seq_ids), dtype=bool), source="tiny")


def cost(compute_ms: float = 2.0, link_gbps: float = 1.0) -> CostModel:
    """1 MB experts over 1 GB/s with no latency: 1 ms per transfer."""
    return CostModel(
        name="tiny",
        layer_compute_ms=compute_ms,
        host_to_device_gbps=link_gbps,
        disk_to_host_gbps=link_gbps,
        host_to_device_latency_ms=0.0,
        disk_to_host_latency_ms=0.0,
    )


class ScriptedPredictor(Predictor):
    """Predicts script[layer] for layer layer_now + 1 of the current iteration, with score 1."""

    def __init__(self, topology: Topology, script: dict[int, list[int]]):
        super().__init__(topology)
        self.script = script

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        target = layer_now + 1
        if target >= self.topology.num_layers:
            return []
        return [Prediction(target, e, 1.0, 0) for e in self.script.get(target, [])]


class Scripted(Policy):
    """LRU eviction, default planner, a scripted predictor (not registered)."""

    script: dict[int, list[int]] = {}

    def make_predictor(self) -> Predictor:
        return ScriptedPredictor(self.topology, self.script)


def scripted(topo: Topology, script: dict[int, list[int]]) -> Policy:
    return type("ScriptedPolicy", (Scripted,), {"script": script})(topo)
