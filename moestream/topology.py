"""The shape of a model's expert layers, shared by the engine, traces and the simulator."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator, NamedTuple


class ExpertKey(NamedTuple):
    layer: int  # index among the MoE layers (0..num_layers-1), not the decoder-layer index
    expert: int


@dataclass(frozen=True)
class Topology:
    moe_layer_ids: tuple[int, ...]  # decoder-layer index of each MoE layer
    num_experts: int  # routed experts per MoE layer
    top_k: int
    expert_bytes: int  # bytes of one routed expert's weights
    num_shared_experts: int = 0  # always-active experts per layer (kept with the dense part)

    def __post_init__(self):
        object.__setattr__(self, "moe_layer_ids", tuple(int(i) for i in self.moe_layer_ids))
        if not self.moe_layer_ids:
            raise ValueError("topology needs at least one MoE layer")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"need 1 <= top_k ({self.top_k}) <= num_experts ({self.num_experts})")
        if self.expert_bytes < 0 or self.num_shared_experts < 0:
            raise ValueError("expert_bytes and num_shared_experts must be >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def total_expert_bytes(self) -> int:
        return self.total_experts * self.expert_bytes

    def routes_like(self, other: "Topology") -> bool:
        """Whether routing sees the same shape (MoE layers, experts per layer, top_k); sizes may differ."""
        return (self.num_layers, self.num_experts, self.top_k) == (other.num_layers, other.num_experts, other.top_k)

    def routing_shape(self) -> str:
        """What routing sees, for messages: '26 MoE layers x 64 experts, top-6'."""
        return f"{self.num_layers} MoE layers x {self.num_experts} experts, top-{self.top_k}"

    def keys(self) -> Iterator[ExpertKey]:
        return (ExpertKey(layer, expert) for layer in range(self.num_layers) for expert in range(self.num_experts))

    def slots_for_ratio(self, ratio: float) -> int:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"cache ratio must be in (0, 1], got {ratio}")
        return max(1, int(self.total_experts * ratio))

    def to_dict(self) -> dict:
        return asdict(self) | {"moe_layer_ids": list(self.moe_layer_ids)}

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        return cls(**data)
