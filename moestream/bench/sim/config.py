"""Settings of one simulation: cache budget, cost model, workload mode, prediction horizon.

Plain, validated data; `moestream sim`'s flags are generated from its fields (moestream.settings), each
declared once. Knows no policy and no trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from moestream.bench.sim.cost import DEFAULT_COST_MODEL, CostModel, get_cost_model
from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.link_model import LinkFigures
from moestream.policies.compute_placement import ComputeCosts, compute_rule
from moestream.settings import same_as, setting
from moestream.topology import Topology

MODES = ("decode", "prefill", "batched")
PROTOCOL_EVICTIONS = ("lru", "policy")
EXPERT_ORDERS = ("ready", "given", "loaded")  # the engine's reordering, --no-reorder, --sync


class SimConfigError(MoestreamError):
    """A simulation setting out of range."""


@dataclass(frozen=True)
class SimConfig:
    """The settings of one replay; those with help text are `moestream sim`'s flags (moestream.settings)."""

    cache_ratio: float  # device-tier slots as a fraction of all routed experts, in (0, 1]
    cost: CostModel = field(default_factory=lambda: get_cost_model(DEFAULT_COST_MODEL))
    horizon_layers: int = same_as(EngineConfig, "horizon_layers")  # how far ahead the predictor is asked
    # decode: one token per iteration; prefill: a prompt; batched: B sequences
    mode: str = setting("decode", "workload of the stream protocol", choices=MODES)
    batch_size: int = setting(1, "sequences per iteration (--mode batched)")
    host_cache_ratio: float = setting(1.0, "host-tier share of experts (GPU presets)", flag="--host-ratio")
    seed: int = setting(0, "seed of the moe-beyond pool refills")  # the random refill of the pool at each prompt
    warmup_tokens: int = setting(10, "unscored tokens per prompt (moe-beyond)")
    protocol_eviction: str = setting("lru", "moe-beyond eviction", choices=PROTOCOL_EVICTIONS)  # lru: the study's
    expert_order: str = setting("ready", "how a layer's experts compute beside their loads (with --routed-expert-ms): "
                                         "ready (the engine's reordering), given (--no-reorder), loaded (--sync)",
                                choices=EXPERT_ORDERS)  # sim.engine
    sync: bool = same_as(EngineConfig, "sync", help="move experts on the compute thread, as the engine's --sync: "
                                                     "each call's rounds run before it returns")
    chunks_in_flight: int = same_as(EngineConfig, "chunks_in_flight")  # the speculative chunks of a link's round
    num_expert_chunks: int = setting(3, "chunks of one expert's transfer (the engine moves one per weight matrix)",
                                     minimum=1)
    device_slots: int = 0  # device-tier slots if not cache_ratio of all experts (one rank of several); 0: the ratio's
    host_slots: int = 0  # host-tier slots if not host_cache_ratio of all experts; 0: the ratio's
    modelled_link: bool = True  # the planner sees the cost model's link (off: an engine without --link-gbps)
    link_figures: LinkFigures | None = None  # instead, the link an engine was given (its --link-gbps, --layer-ms)
    host_compute: str = same_as(  # a rule of moestream.policies.compute_placement
        EngineConfig, "host_compute", metavar=None,
        help="where misses in host memory compute (stream protocol): off (all on the device), share:F (a share F of "
             "them on the host, fewest rows first) or default (the placement with the earliest modelled finish); "
             "beside each policy, the misses each side took and the stall saved against off")
    hidden_bytes: int = setting(0, "bytes of one token's hidden state (2 x hidden size), on the network and on a "
                                   "--host-compute row's trip; 0: the synthetic:NAME shape's (host compute without "
                                   "one: estimated from the expert size)", minimum=0)
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
        if min(self.chunks_in_flight, self.num_expert_chunks) < 1:
            raise SimConfigError("chunks_in_flight and num_expert_chunks must be >= 1")
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
        """A host tier that must be simulated: it holds only part of the experts (or is given in slots)."""
        return self.host_slots > 0 or (self.cost.host_holds_all and self.host_cache_ratio < 1.0)

    def device_slots_of(self, topology: Topology) -> int:
        return self.device_slots or topology.slots_for_ratio(self.cache_ratio)

    def host_slots_of(self, topology: Topology) -> int:
        return self.host_slots or topology.slots_for_ratio(self.host_cache_ratio)


@dataclass(frozen=True)
class CostOverrides:
    """`moestream sim`'s overrides of its cost model's figures (moestream.bench.sim.cost.CostModel's fields of the
    same names; link_*: those of the link that fills the device tier); None keeps the model's."""

    layer_compute_ms: float | None = setting(None, "compute of one MoE layer, one decode token", type=float)
    expert_compute_ms: float | None = setting(None, "compute of each further distinct expert", type=float)
    token_compute_ms: float | None = setting(None, "compute of each further token", type=float)
    routed_expert_ms: float | None = setting(None, "one routed expert's compute for one token", type=float)
    link_gbps: float | None = setting(None, "bandwidth of the link that fills the device tier (GB/s)", type=float)
    link_latency_ms: float | None = setting(None, "per-transfer latency of that link", type=float)
    disk_to_host_gbps: float | None = setting(None, "disk -> host bandwidth (GB/s)", flag="--disk-gbps", type=float)
    disk_to_host_latency_ms: float | None = setting(None, "disk -> host per-transfer latency",
                                                    flag="--disk-latency-ms", type=float)
    host_expert_gbps: float | None = setting(None, "--host-compute: the host's expert-MLP weight streaming (GB/s)",
                                             type=float)
    host_tflops: float | None = setting(None, "--host-compute: the host's expert-MLP arithmetic (TFLOP/s)",
                                        type=float)
    device_expert_gbps: float | None = setting(None, "--host-compute: the device's expert weight streaming (GB/s)",
                                               type=float)
    device_tflops: float | None = setting(None, "--host-compute: the device's expert arithmetic (TFLOP/s)",
                                          type=float)

    def apply(self, cost: CostModel) -> CostModel:
        """cost with the given figures replaced (where the device tier fills from disk, --link-gbps and
        --disk-gbps name one link: the latter wins)."""
        link = {"link_gbps": f"{cost.device_link}_gbps", "link_latency_ms": f"{cost.device_link}_latency_ms"}
        return cost.with_overrides(**{link.get(f.name, f.name): getattr(self, f.name) for f in fields(self)
                                      if getattr(self, f.name) is not None})
