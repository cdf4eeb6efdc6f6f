"""Memory budgets of the two expert tiers and how many expert slots they buy (budget bytes // expert
bytes); budgets that cannot serve one token of one layer are refused. Knows no policy, file or tensor.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass

import torch

from moestream.budget import Budget, format_bytes
from moestream.config import EngineConfig, store_rules
from moestream.errors import BudgetError
from moestream.settings import check, same_as
from moestream.topology import Topology


@dataclass(frozen=True)
class StoreConfig:
    """The settings of EngineConfig (moestream.config) that the store reads: the budgets of the device tier
    (compute memory) and host tier (RAM), and how to move experts (asynchronous: on workers beside the caller).
    """

    device_budget: Budget
    host_budget: Budget
    device: str = same_as(EngineConfig, "device")
    direct_io: bool = same_as(EngineConfig, "direct_io")
    asynchronous: bool = False
    chunk_bytes: int = same_as(EngineConfig, "chunk_bytes")
    chunks_in_flight: int = same_as(EngineConfig, "chunks_in_flight")
    transfer_timeout_s: float = same_as(EngineConfig, "transfer_timeout_s")
    keep_host_tier: bool = False  # a host tier apart even where it would join the device tier (host compute)

    validated: InitVar[bool] = False  # by EngineConfig, whose rules (store_rules, the bounds) these are

    def __post_init__(self, validated: bool):
        if not validated:
            rules = store_rules(self.device_budget, self.host_budget, self.device, "device_budget")
            for name, value in zip(("device_budget", "host_budget", "device"), rules):
                object.__setattr__(self, name, value)
            check(self)

    @classmethod
    def of(cls, config: EngineConfig) -> "StoreConfig":
        """The store's settings among the engine's, which EngineConfig validated (not again here)."""
        return cls(device_budget=config.expert_budget, host_budget=config.host_budget, device=config.device,
                   direct_io=config.direct_io, asynchronous=not config.sync, chunk_bytes=config.chunk_bytes,
                   chunks_in_flight=config.chunks_in_flight, transfer_timeout_s=config.transfer_timeout_s,
                   keep_host_tier=config.host_compute != "off", validated=True)

    @property
    def uses_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def device_slots(self, topology: Topology) -> int:
        """Expert slots of the device tier; refuses a budget smaller than one layer's top_k experts."""
        expert_bytes = _expert_bytes(topology)
        budget_bytes = self.device_budget.resolve(topology.total_expert_bytes)
        slots = min(budget_bytes // expert_bytes, topology.total_experts)
        if slots < topology.top_k:
            minimum, ratio = topology.top_k * expert_bytes, _round_up(topology.top_k / topology.total_experts)
            raise BudgetError(
                f"device budget of {budget_bytes} bytes ({format_bytes(budget_bytes)}) holds {slots} experts of "
                f"{expert_bytes} bytes, but one layer routes top_k={topology.top_k} experts per token: "
                f"the minimum is {minimum}B ({format_bytes(minimum)}), a ratio of {ratio:g} of the "
                f"{topology.total_expert_bytes} routed-expert bytes")
        return slots

    def host_slots(self, topology: Topology) -> int:
        """Expert slots of the host tier (0 disables it: disk reads go straight to the device tier)."""
        budget_bytes = self.host_budget.resolve(topology.total_expert_bytes)
        return min(budget_bytes // _expert_bytes(topology), topology.total_experts)


def _expert_bytes(topology: Topology) -> int:
    if topology.expert_bytes <= 0:
        raise BudgetError("the model's routed experts have 0 bytes; nothing to store")
    return topology.expert_bytes


def _round_up(ratio: float, digits: int = 4) -> float:
    """ratio rounded up to `digits` significant digits, so that the printed minimum suffices."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(ratio)))
    return math.ceil(ratio * scale) / scale
