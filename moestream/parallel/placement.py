"""Expert placement: which rank owns each routed expert of each MoE layer, computed once from a Topology,
the number of ranks and, for some, a routing trace's activation statistics; saved and loaded as JSON. Must
not know how ranks talk, how experts are loaded or timed, nor import torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moestream.atomic import atomic_path
from moestream.errors import MoestreamError
from moestream.registry import Registry
from moestream.topology import ExpertKey, Topology


@dataclass(frozen=True)
class ActivationStats:
    """How often each expert is chosen, and how often two experts of a layer are chosen together."""

    counts: np.ndarray  # [L, E] tokens routed to each expert
    coactivation: np.ndarray | None = None  # [L, E, E] tokens routed to both (diagonal = counts)

    @classmethod
    def from_routing(cls, experts: np.ndarray, num_experts: int) -> "ActivationStats":
        """From a trace's routed expert ids, experts [N, L, K]."""
        n, num_layers, _ = experts.shape
        onehot = np.zeros((n, num_layers, num_experts), dtype=np.float64)  # [N, L, E]
        np.put_along_axis(onehot, experts.astype(np.int64), 1.0, axis=2)
        by_layer = onehot.transpose(1, 0, 2)  # [L, N, E]
        return cls(counts=onehot.sum(axis=0), coactivation=by_layer.transpose(0, 2, 1) @ by_layer)  # [L, E], [L, E, E]


@dataclass(frozen=True)
class Placement:
    """owners[layer][expert] = the rank that owns ExpertKey(layer, expert)."""

    name: str
    world_size: int
    owners: tuple[tuple[int, ...], ...]  # [L][E] rank ids

    def __post_init__(self):
        flat = [rank for layer in self.owners for rank in layer]
        if self.world_size < 1 or any(not 0 <= rank < self.world_size for rank in flat):
            raise MoestreamError(f"placement {self.name!r}: ranks must lie in [0, {self.world_size})")

    def rank_of(self, key: ExpertKey) -> int:
        return self.owners[key.layer][key.expert]

    def experts_of(self, rank: int) -> list[ExpertKey]:
        return [ExpertKey(layer, expert) for layer, row in enumerate(self.owners)
                for expert, owner in enumerate(row) if owner == rank]

    def mapping(self) -> dict[ExpertKey, int]:
        return {ExpertKey(layer, expert): owner for layer, row in enumerate(self.owners)
                for expert, owner in enumerate(row)}

    def fits(self, topology: Topology) -> bool:
        return len(self.owners) == topology.num_layers and all(len(row) == topology.num_experts for row in self.owners)

    def rank_loads(self, counts: np.ndarray) -> np.ndarray:
        """Expected routed rows per rank and layer, [L, R], from activation counts [L, E]."""
        owners = np.asarray(self.owners)  # [L, E]
        return np.stack([(counts * (owners == rank)).sum(axis=1) for rank in range(self.world_size)], 1).astype(float)

    def save(self, path: str | Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(dataclasses.asdict(self)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Placement":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise MoestreamError(f"cannot read placement {path}: {error}") from None
        try:
            owners = tuple(tuple(int(r) for r in row) for row in data["owners"])
            return cls(name=str(data["name"]), world_size=int(data["world_size"]), owners=owners)
        except (KeyError, TypeError, ValueError) as error:
            raise MoestreamError(f"malformed placement: {error}") from None


class Placer:
    """Assigns every expert of a topology to one of world_size ranks."""

    needs_stats = False

    def place(self, topology: Topology, world_size: int, stats: ActivationStats | None = None) -> Placement:
        raise NotImplementedError


PLACEMENTS: Registry[Placer] = Registry("placement")


def make_placement(name: str, topology: Topology, world_size: int,
                   stats: ActivationStats | None = None) -> Placement:
    """The named placement; one that needs activation statistics refuses to run without them."""
    placer = PLACEMENTS.create(name)
    if world_size < 1:
        raise MoestreamError(f"need at least one rank, got {world_size}")
    if placer.needs_stats and stats is None:
        raise MoestreamError(f"placement {name!r} needs a routing trace's activation counts")
    return placer.place(topology, world_size, stats)


@PLACEMENTS.register("round-robin")
class RoundRobin(Placer):
    """Expert e of every layer goes to rank e mod world_size (as MoE-Infinity and fMoE)."""

    def place(self, topology: Topology, world_size: int, stats: ActivationStats | None = None) -> Placement:
        row = tuple(expert % world_size for expert in range(topology.num_experts))
        return Placement(self.registry_name, world_size, (row,) * topology.num_layers)


@PLACEMENTS.register("balanced")
class Balanced(Placer):
    """Per layer, experts in decreasing activation count go greedily to the rank whose expected load plus
    co-activation with the experts it holds is least, at most ceil(E / R) experts per rank (the same bytes within
    one expert); ties to the lowest rank."""

    needs_stats = True

    def place(self, topology: Topology, world_size: int, stats: ActivationStats | None = None) -> Placement:
        rows = tuple(self._layer(stats, layer, world_size) for layer in range(topology.num_layers))
        return Placement(self.registry_name, world_size, rows)

    def _layer(self, stats: ActivationStats, layer: int, world_size: int) -> tuple[int, ...]:
        counts = stats.counts[layer]  # [E]
        capacity = -(-len(counts) // world_size)
        owners, loads = np.full(len(counts), -1), np.zeros(world_size)
        for expert in np.argsort(-counts, kind="stable"):
            cost = loads + self._shared(stats, layer, expert, owners, world_size)
            cost[np.bincount(owners[owners >= 0], minlength=world_size) >= capacity] = np.inf
            rank = int(np.argmin(cost))
            owners[expert] = rank
            loads[rank] += counts[expert]
        return tuple(int(r) for r in owners)

    @staticmethod
    def _shared(stats: ActivationStats, layer: int, expert: int, owners: np.ndarray, world_size: int) -> np.ndarray:
        """Tokens that route to expert and to an expert each rank already holds, [R]."""
        if stats.coactivation is None:
            return np.zeros(world_size)
        placed = owners >= 0
        return np.bincount(owners[placed], weights=stats.coactivation[layer, expert][placed], minlength=world_size)
