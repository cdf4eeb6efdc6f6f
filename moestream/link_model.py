"""A modelled link: the backlog of bytes admitted to the link that fills the device tier, advanced by a virtual
clock of one MoE layer's compute per layer, that the planner's view reports (`LinkState`). The transfer core feeds
it the same admissions in the engine and the simulator (docs/design.md, "The link as the planner sees it"), so
both compute the same backlog. It reads no clock or measurement, knows no policy, and is not what the real link
does (its bandwidth and layer time are fixed figures of the run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from moestream.contracts import LinkState
from moestream.topology import ExpertKey, Topology


@dataclass(frozen=True)
class LinkFigures:
    """A run's fixed figures of the disk link (`EngineConfig`): one link model for the engine and a simulator alike."""

    gbps: float
    layer_ms: float
    reorder: bool = True  # a layer computes its missed experts as they land: one expert's share after the last

    def model(self, topology: Topology) -> "ModelledLink":
        tail_ms = self.layer_ms / topology.top_k if self.reorder else self.layer_ms
        return ModelledLink(self.gbps * 1e6, self.layer_ms, topology.expert_bytes, topology.num_layers, tail_ms)


class _Read:
    """One expert's read in the model: its bytes still to move, and whether a layer waits for it."""

    __slots__ = ("key", "left", "demand")

    def __init__(self, key: ExpertKey, left: float, demand: bool):
        self.key, self.left, self.demand = key, left, demand


class ModelledLink:
    def __init__(self, bytes_per_ms: float, layer_ms: float, expert_bytes: int, num_layers: int, tail_ms: float):
        if bytes_per_ms <= 0 or not 0 <= tail_ms <= layer_ms or expert_bytes <= 0 or num_layers < 1:
            raise ValueError(f"a modelled link needs a bandwidth > 0, 0 <= tail <= layer time, expert bytes > 0 "
                             f"and layers >= 1; got {bytes_per_ms}, {tail_ms}, {layer_ms}, {expert_bytes}, {num_layers}")
        self.bytes_per_ms, self.layer_ms, self.tail_ms = bytes_per_ms, layer_ms, tail_ms
        self.expert_bytes, self.num_layers = expert_bytes, num_layers
        self.reads: list[_Read] = []  # in the link's order: under way, demand, then not started
        self.layer: int | None = None  # the last layer a lookup or a plan named

    def need(self, key: ExpertKey) -> None:
        """A layer found key in the tier or on its way: its read becomes demand (ahead of those not started)."""
        self._at(key.layer)
        for read in self.reads:
            if read.key == key and not read.demand:
                read.demand = True
                if read.left == self.expert_bytes:
                    self.reads.remove(read)
                    self._insert_demand(read)
                return

    def demand(self, key: ExpertKey) -> None:
        """key missed: its read goes ahead of every read not started."""
        self._at(key.layer)
        self._insert_demand(_Read(key, float(self.expert_bytes), True))

    def speculate(self, keys: Iterable[ExpertKey]) -> None:
        """A plan's prefetches, admitted in its order."""
        self.reads += [_Read(key, float(self.expert_bytes), False) for key in keys]

    def drop(self, key: ExpertKey) -> None:
        """key left the tier (evicted or failed): a read of it not yet done is no more."""
        self.reads = [read for read in self.reads if read.key != key]

    def state(self, layer_now: int) -> LinkState:
        """What a plan after layer_now sees."""
        if layer_now >= 0:
            self._at(layer_now)
        backlog = sum(read.left for read in self.reads)
        return LinkState(self.bytes_per_ms, self.layer_ms, self.expert_bytes, backlog, self._layer_end_ms())

    def _at(self, layer: int) -> None:
        """A lookup or a plan names layer: the layers since the last one named have computed."""
        if self.layer is not None and layer != self.layer:
            passed = (layer - self.layer) % self.num_layers
            self._move(self._layer_end_ms() + (passed - 1) * self.layer_ms)
        self.layer = layer

    def _layer_end_ms(self) -> float:
        """The routed layer ends after its compute, and tail_ms after its last demand load lands."""
        last = max((i for i, read in enumerate(self.reads) if read.demand), default=-1)
        if last < 0:
            return self.layer_ms
        landed_ms = sum(read.left for read in self.reads[: last + 1]) / self.bytes_per_ms
        return max(self.layer_ms, landed_ms + self.tail_ms)

    def _move(self, ms: float) -> None:
        """The link moves ms worth of bytes, front first."""
        budget = ms * self.bytes_per_ms
        while self.reads and budget > 0:
            read = self.reads[0]
            moved = min(read.left, budget)
            read.left -= moved
            budget -= moved
            if read.left <= 0:
                self.reads.pop(0)

    def _insert_demand(self, read: _Read) -> None:
        """Behind the reads under way and the other demand, ahead of those not started."""
        at = next((i for i, other in enumerate(self.reads) if not other.demand and other.left == self.expert_bytes),
                  len(self.reads))
        self.reads.insert(at, read)
