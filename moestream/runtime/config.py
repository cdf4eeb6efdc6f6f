"""Settings of the offloading engine: where it computes, the expert budgets, the policy.

Validated on construction, so that a bad flag fails before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.store.config import Budget, StoreConfig


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # where the dense part and the device tier live: "cpu" or "cuda[:N]"
    expert_budget: Budget | str = "0.25"  # device tier: ratio of the routed-expert bytes, or a size
    host_budget: Budget | str = "0"  # host tier between disk and device (0: none; async on the CPU: one tier)
    policy: str = "lru"  # name in moestream.policies.POLICIES
    horizon_layers: int = 2  # how many MoE layers ahead the policy predicts after each layer
    direct_io: bool = True  # read experts with O_DIRECT where the filesystem allows it
    publish_gate_probs: bool = False  # add the router's full distribution to routing events
    publish_hidden: bool = False  # add router inputs to routing events even if no policy asks
    predictor_dir: str | None = None  # a trained predictor for the policy (`moestream train-predictor`)
    sync: bool = False  # transfers on the compute thread, on demand (the baseline); else beside compute
    replay_routing: str | None = None  # follow this trace's routing instead of the router's (measurement only)
    chunk_bytes: int = 0  # largest piece of one expert transfer (0: one weight matrix)
    chunks_in_flight: int = 8  # speculative chunks read together: the most a demand miss waits behind
    reorder: bool = True  # a layer computes resident experts first, then the others as they land
    transfer_timeout_s: float = 60.0  # longest wait for expert bytes before it fails

    def __post_init__(self):
        store = self.store_config()  # validates budgets and the device
        object.__setattr__(self, "expert_budget", store.device_budget)
        object.__setattr__(self, "host_budget", store.host_budget)
        object.__setattr__(self, "device", store.device)
        if POLICIES.get(self.policy).offline:
            raise MoestreamError(f"policy {self.policy!r} needs the future routing of a trace; "
                                 "it runs in the simulator only")
        if self.horizon_layers < 0:
            raise MoestreamError(f"horizon_layers must be >= 0, got {self.horizon_layers}")

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            device_budget=self.expert_budget,
            host_budget=self.host_budget,
            device=self.device,
            direct_io=self.direct_io,
            asynchronous=not self.sync,
            chunk_bytes=self.chunk_bytes,
            chunks_in_flight=self.chunks_in_flight,
            transfer_timeout_s=self.transfer_timeout_s,
        )
