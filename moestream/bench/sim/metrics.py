"""What a simulation measured: counters filled by the protocols and the figures derived from them.

An access is one distinct expert needed by one MoE layer in one iteration (in decode, one of a
token's top-k experts); it is a hit when the expert is in the device tier when the gate routes,
its bytes landed or still moving (the transfer core's rule: the wait of a late one is stall).
A prefetch is a transfer the planner asked for; it is *late* when its expert was needed while it
was still moving, *wasted* when it was evicted before any use. Prefetches that the mechanism
promoted to demand loads before they started count as demand loads, not prefetches.
This module knows nothing of policies or of how the counters are filled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


@dataclass
class LayerCounts:
    """Hits and accesses per MoE layer."""

    num_layers: int
    hits: list[int] = field(default_factory=list)
    accesses: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.hits = self.hits or [0] * self.num_layers
        self.accesses = self.accesses or [0] * self.num_layers

    @property
    def total_hits(self) -> int:
        return sum(self.hits)

    @property
    def total_accesses(self) -> int:
        return sum(self.accesses)

    def hit_rate(self) -> float:
        return _ratio(self.total_hits, self.total_accesses)

    def per_layer(self) -> list[float]:
        return [_ratio(h, a) for h, a in zip(self.hits, self.accesses)]


@dataclass
class StreamCounters:
    """Everything the stream simulator counts while it replays a trace."""

    layers: LayerCounts
    num_tokens: int = 0
    num_iterations: int = 0
    sim_ms: float = 0.0  # virtual time of the whole replay
    resident_ms: float = 0.0  # the same replay with every expert resident (no stalls)
    stall_ms: float = 0.0
    host_hits: int = 0  # device fills (and misses the host computes from its slots) served by the host tier
    host_accesses: int = 0  # device fills, and misses the host computes from its slots
    demand_fetches: int = 0
    host_computed: int = 0  # device misses computed on the host (sim.host_compute), not loaded
    prefetches_admitted: int = 0  # a plan's experts given a slot (each starts, is promoted or is dropped)
    prefetches_started: int = 0
    prefetches_landed: int = 0
    prefetches_dropped: int = 0  # refused (no host slot), or cancelled in a queue before they landed
    prefetch_hits: int = 0  # hits on an expert a prefetch brought in and nobody used yet
    late_prefetches: int = 0
    wasted_prefetches: int = 0
    bytes_by_link: dict[str, int] = field(default_factory=dict)

    def summary(self, device_link: str) -> dict:
        tokens = self.num_tokens
        return {
            "hit_rate": self.layers.hit_rate(),
            "stall_ms_per_token": _ratio(self.stall_ms, tokens),
            "tpot_ms": _ratio(self.sim_ms, self.num_iterations),
            "resident_tpot_ms": _ratio(self.resident_ms, self.num_iterations),
            "tpot_ratio_vs_resident": _ratio(self.sim_ms, self.resident_ms),
            "bytes_per_token": _ratio(self.bytes_by_link.get(device_link, 0), tokens),
            "wasted_prefetch_ratio": _ratio(self.wasted_prefetches, self.prefetches_admitted),
            "late_prefetch_ratio": _ratio(self.late_prefetches, self.prefetches_started),
            "per_layer_hit_rate": self.layers.per_layer(),
            "tier_hit_rate": {"device": self.layers.hit_rate(), "host": _ratio(self.host_hits, self.host_accesses)},
            "accesses": self.layers.total_accesses,
            "hits": self.layers.total_hits,
            "num_tokens": tokens,
            "num_iterations": self.num_iterations,
            "sim_ms": self.sim_ms,
            "resident_ms": self.resident_ms,
            "stall_ms": self.stall_ms,
            "demand_fetches": self.demand_fetches,
            "host_computed_misses": self.host_computed,
            "device_computed_misses": self.layers.total_accesses - self.layers.total_hits - self.host_computed,
            "prefetches": self.prefetches_started,
            "prefetches_landed": self.prefetches_landed,
            "prefetches_dropped": self.prefetches_dropped,
            "prefetch_hits": self.prefetch_hits,
            "late_prefetches": self.late_prefetches,
            "wasted_prefetches": self.wasted_prefetches,
            "bytes_by_link": dict(self.bytes_by_link),
        }


@dataclass
class MoeBeyondCounters:
    """The MoE-Beyond protocol counts scored lookups only (after each prompt's warm-up)."""

    layers: LayerCounts
    num_prompts: int = 0
    scored_prompts: int = 0
    scored_tokens: int = 0
    pushed: int = 0  # predicted experts pushed through the pool

    def summary(self) -> dict:
        return {
            "hit_rate": self.layers.hit_rate(),
            "stall_ms_per_token": None,
            "tpot_ratio_vs_resident": None,
            "bytes_per_token": None,
            "wasted_prefetch_ratio": None,
            "late_prefetch_ratio": None,
            "per_layer_hit_rate": self.layers.per_layer(),
            "accesses": self.layers.total_accesses,
            "hits": self.layers.total_hits,
            "num_prompts": self.num_prompts,
            "scored_prompts": self.scored_prompts,
            "scored_tokens": self.scored_tokens,
            "pushed_per_scored_token": _ratio(self.pushed, self.scored_tokens),
        }
