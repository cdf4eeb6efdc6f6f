"""Settings of one simulation: cache budget, cost model, workload mode, prediction horizon.

Plain, validated data; the CLI maps its flags onto it. Knows no policy and no trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moestream.errors import MoestreamError
from moestream.link_model import LinkFigures
from moestream.policies.compute_placement import ComputeCosts, compute_rule
from moestream.sim.cost import DEFAULT_COST_MODEL, CostModel, get_cost_model
from moestream.topology import Topology

MODES = ("decode", "prefill", "batched")
PROTOCOL_EVICTIONS = ("lru", "policy")
EXPERT_ORDERS = ("ready", "given", "loaded")  # the engine's reordering, --no-reorder, --sync


class SimConfigError(MoestreamError):
    """A simulation setting out of range."""


@dataclass(frozen=True)
class SimConfig:
    cache_ratio: float  # device-tier slots as a fraction of all routed experts, in (0, 1]
    cost: CostModel = field(default_factory=lambda: get_cost_model(DEFAULT_COST_MODEL))
    mode: str = "decode"  # decode: one token per iteration; prefill: a prompt; batched: B sequences
    batch_size: int = 1  # sequences per iteration in batched mode
    horizon_layers: int = 2  # how many MoE layers ahead the predictor is asked about
    host_cache_ratio: float = 1.0  # host-tier slots as a fraction of all experts (GPU presets)
    seed: int = 0  # MoE-Beyond protocol: the random refill of the pool at each prompt
    warmup_tokens: int = 10  # MoE-Beyond protocol: unscored tokens at the start of each prompt
    protocol_eviction: str = "lru"  # MoE-Beyond protocol: "lru" (the study's) or the policy's own
    expert_order: str = "ready"  # how a layer's experts compute beside their loads (EXPERT_ORDERS; sim.engine)
    device_slots: int = 0  # device-tier slots if not cache_ratio of all experts (one rank of several); 0: the ratio's
    host_slots: int = 0  # host-tier slots if not host_cache_ratio of all experts; 0: the ratio's
    modelled_link: bool = True  # the planner sees the cost model's link (off: an engine without --link-gbps)
    link_figures: LinkFigures | None = None  # instead, the link an engine was given (its --link-gbps, --layer-ms)
    host_compute: str = "off"  # where host-tier misses compute: a rule of moestream.policies.compute_placement
    hidden_bytes: int = 0  # one token's hidden state (2 x hidden size), a host-computed row's trip; 0: estimated
    compute_costs: ComputeCosts | None = None  # host compute's figures as an engine measured them; None: the cost's

    def __post_init__(self):
        if not 0.0 < self.cache_ratio <= 1.0:
            raise SimConfigError(f"cache ratio must be in (0, 1], got {self.cache_ratio}")
        if not 0.0 < self.host_cache_ratio <= 1.0:
            raise SimConfigError(f"host cache ratio must be in (0, 1], got {self.host_cache_ratio}")
        if self.host_cache_ratio < 1.0 and not self.cost.host_holds_all:
            raise SimConfigError(f"cost model {self.cost.name!r} has no host tier to size")
        if self.mode not in MODES:
            raise SimConfigError(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.batch_size < 1:
            raise SimConfigError(f"batch size must be >= 1, got {self.batch_size}")
        if min(self.horizon_layers, self.warmup_tokens, self.device_slots, self.host_slots) < 0:
            raise SimConfigError("horizon_layers, warmup_tokens, device_slots and host_slots must be >= 0")
        if self.expert_order not in EXPERT_ORDERS:
            raise SimConfigError(f"unknown expert order {self.expert_order!r}; known: {', '.join(EXPERT_ORDERS)}")
        if self.hidden_bytes < 0:
            raise SimConfigError(f"hidden_bytes must be >= 0, got {self.hidden_bytes}")
        compute_rule(self.host_compute)  # a bad rule: MoestreamError naming --host-compute
        if self.host_compute != "off" and not (self.cost.computes_on_host or self.given_host_costs):
            raise SimConfigError(f"--host-compute {self.host_compute}: cost model {self.cost.name!r} has no host that "
                                 "holds experts or no host-compute figures (host_expert_gbps, host_tflops, "
                                 "device_expert_gbps, device_tflops)")
        if self.protocol_eviction not in PROTOCOL_EVICTIONS:
            raise SimConfigError(
                f"unknown protocol eviction {self.protocol_eviction!r}; known: {', '.join(PROTOCOL_EVICTIONS)}"
            )

    @property
    def given_host_costs(self) -> bool:
        """Host compute's figures given (an engine's), for a host that holds every expert."""
        return self.compute_costs is not None and self.cost.host_holds_all

    @property
    def has_host_tier(self) -> bool:
        """A host tier that must be simulated: it holds only part of the experts."""
        return self.cost.host_holds_all and self.host_cache_ratio < 1.0

    def device_slots_of(self, topology: Topology) -> int:
        return self.device_slots or topology.slots_for_ratio(self.cache_ratio)

    def host_slots_of(self, topology: Topology) -> int:
        return self.host_slots or topology.slots_for_ratio(self.host_cache_ratio)
