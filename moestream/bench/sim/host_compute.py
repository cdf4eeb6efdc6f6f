"""Host compute in the stream simulator: which of a layer's device-tier misses compute on the host.

At each layer the misses whose bytes are ready in the host tier (every miss where host DRAM holds all
experts), then a few only on disk (`layer_candidates`: one placed on the host is read by the host lane,
at disk_to_host's time, and enters no tier) are candidates; the config's rule
(`moestream.policies.compute_placement`) names those that compute on the host. They are not copied to
the device tier (no link transfer, no device-tier slot) but take `ComputeCosts.host_ms(rows)` each, one
after another, on a host lane that starts when the layer is routed and runs beside the device's compute;
the layer ends when both lanes are done. Rows per expert are the layer's (token, k) routing rows. The
cost figures are the cost model's (its host and device rates, its host -> device link) with the
topology's expert size, or an engine's measured ones (`SimConfig.compute_costs`, as `bench fidelity`
gives them); each layer step's choice is kept in `placements`, in the engine's form
(`moestream.runtime.host_compute`). Knows no policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moestream.bench.sim.config import SimConfig
from moestream.policies.compute_placement import ComputeCosts, ComputeRule, compute_rule, layer_candidates
from moestream.topology import ExpertKey, Topology
from moestream.transfer_core import LATE, MISS, TransferCore


def compute_costs(config: SimConfig, topology: Topology) -> ComputeCosts:
    """The rule's cost model: the config's cost model's rates and link, the topology's expert size. A row's
    hidden state is config.hidden_bytes, else estimated as 2 bytes x sqrt(params / 3) (a square expert)."""
    cost = config.cost
    params = max(1, round(topology.expert_bytes / cost.weight_bytes))
    row_bytes = config.hidden_bytes or 2 * max(1, round(math.sqrt(params / 3)))
    return ComputeCosts(
        link_bytes_per_ms=cost.host_to_device_gbps * 1e6,
        host_bytes_per_ms=cost.host_expert_gbps * 1e6,
        device_bytes_per_ms=cost.device_expert_gbps * 1e6,
        host_flops_per_ms=cost.host_tflops * 1e9,
        device_flops_per_ms=cost.device_tflops * 1e9,
        expert_bytes=topology.expert_bytes,
        expert_params=params,
        row_bytes=row_bytes,
    )


def expert_rows(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """The (token, k) rows routed to each expert of the layer, [num_experts]."""
    return np.bincount(np.asarray(expert_ids).ravel(), minlength=num_experts)


@dataclass
class Placed:
    """A layer's lookups with host compute: what the device waits for and what the host computes."""

    late: list[ExpertKey]  # in the device tier, still moving (their transfers become demand)
    missed: list[ExpertKey]  # admitted to the device tier: to be loaded
    on_host: list[ExpertKey]  # computed on the host, from its host slot or (from_disk) a read of its own
    host_ms: float  # the host lane's time for them
    from_disk: list[ExpertKey]  # those of on_host read from disk by the host lane (in no tier)


class HostCompute:
    """The config's rule and cost figures, applied at each layer's lookups."""

    def __init__(self, config: SimConfig, topology: Topology):
        self.rule: ComputeRule = compute_rule(config.host_compute)
        self.read_ms = config.cost.transfer_ms(topology.expert_bytes, "disk_to_host")  # a miss only on disk
        self.costs = config.compute_costs or compute_costs(config, topology)
        self.num_experts = topology.num_experts
        self.placements: list[tuple[int, tuple[int, ...]]] = []  # each layer step's experts on the host

    def fetch_layer(self, core: TransferCore, needed: list[ExpertKey], expert_ids: np.ndarray,
                    host_ready, unstarted) -> Placed:
        """The transfer core's fetch_layer with the rule between the lookups and the admissions: every key
        is pinned and looked up; the misses the rule places on the host are unpinned and never admitted.
        host_ready(key): its bytes are in the host tier; unstarted(key): its transfer has not started (a queued
        prefetch becomes a demand load: it crosses the link whatever the rule says)."""
        device = core.device
        device.pin(needed)
        found = [core.lookup(key) for key in needed]
        rows = expert_rows(expert_ids, self.num_experts)
        missed = [key for key, f in zip(needed, found) if f == MISS]
        late = [key for key, f in zip(needed, found) if f == LATE]
        queued = {key for key in late if unstarted(key)}
        candidates = layer_candidates(missed, lambda key: int(rows[key.expert]), host_ready)
        hit_rows = [int(rows[key.expert]) for key, f in zip(needed, found) if f != MISS and key not in queued]
        other = len(missed) - len(candidates) + len(queued)
        chosen = self.rule.place(candidates, hit_rows, other, self.costs) if candidates else frozenset()
        on_host = [key for key in missed if key in chosen]
        if needed:
            self.placements.append((needed[0].layer, tuple(sorted(key.expert for key in on_host))))
        device.unpin(on_host)
        to_load = [key for key in missed if key not in chosen]
        core.admit_demands(to_load, [key for key in needed if key not in chosen])
        from_disk = [c.key for c in candidates if c.from_disk and c.key in chosen]
        host_ms = sum(self.costs.host_ms(int(rows[key.expert])) for key in on_host) + self.read_ms * len(from_disk)
        return Placed(late, to_load, on_host, host_ms, from_disk)
