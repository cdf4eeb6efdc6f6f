"""A run's expert placement from its settings, what each rank owns, and each rank's own budgets: a budget
ratio is of the bytes of the experts the rank owns (N ranks at 0.25 hold together what one process at 0.25
holds), a size is its own memory. Imports no torch.distributed; knows no engine."""

from __future__ import annotations

import dataclasses

import numpy as np

from moestream.budget import Budget, format_bytes
from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.parallel.config import ParallelConfig
from moestream.parallel.placement import PLACEMENTS, ActivationStats, Placement, make_placement
from moestream.topology import Topology


def placement_of(parallel: ParallelConfig, replay_routing: str | None, topology: Topology,
                 world_size: int) -> tuple[Placement, ActivationStats | None]:
    """The placement the settings name, and the activation counts it was made from (if it needs them)."""
    name, trace = parallel.expert_parallel_placement, parallel.expert_parallel_trace or replay_routing
    stats = None
    if PLACEMENTS.get(name).needs_stats:
        if trace is None:
            raise MoestreamError(f"--expert-parallel-placement {name} needs a routing trace: pass "
                                 "--expert-parallel-trace (or --replay-routing)")
        stats = _stats(trace, topology)
    return make_placement(name, topology, world_size, stats), stats


def _stats(trace: str, topology: Topology) -> ActivationStats:
    from moestream.runtime.replay import check_topology
    from moestream.trace.format import load_trace

    routing = load_trace(trace)
    check_topology(routing, topology, trace)
    return ActivationStats.from_routing(routing.experts, topology.num_experts)


def plan_lines(placement: Placement, topology: Topology, stats: ActivationStats | None = None) -> list[str]:
    """One line per rank: the experts and bytes it owns (and its share of the trace's routed rows)."""
    owners = np.asarray(placement.owners)  # [L, E]
    loads = None if stats is None else placement.rank_loads(stats.counts).sum(axis=0)  # [R]
    lines = [f"expert parallelism: {placement.world_size} ranks, placement {placement.name}"]
    for rank in range(placement.world_size):
        count = int((owners == rank).sum())
        share = "" if loads is None else f", {100 * loads[rank] / loads.sum():.1f}% of the trace's routed rows"
        lines.append(f"  rank {rank}: {count} experts ({count / owners.shape[0]:.1f} a layer), "
                     f"{format_bytes(count * topology.expert_bytes)}{share}")
    return lines


def rank_config(config: EngineConfig, placement: Placement, rank: int, topology: Topology,
                device: str | None = None) -> EngineConfig:
    """The rank's settings: its budget ratios are of the bytes of the experts it owns; on its device
    (None: the configured one; one CUDA device per local rank, moestream.parallel.ranks)."""
    owned_bytes = int((np.asarray(placement.owners) == rank).sum()) * topology.expert_bytes

    def own(budget: Budget) -> Budget:
        return budget if budget.ratio is None else Budget(size_bytes=int(budget.ratio * owned_bytes))

    return dataclasses.replace(config, expert_budget=own(config.expert_budget), host_budget=own(config.host_budget),
                               device=device or config.device)
