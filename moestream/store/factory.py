"""Which expert store serves a configuration: its tiers, and where its transfers run (`executor_for`).
On the CPU, host and device memory are the same: there an asynchronous store's host budget joins the
device tier (each expert held once). This module knows no policy.
"""

from __future__ import annotations

import dataclasses

from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.contracts import EvictionPolicy
from moestream.store.config import Budget, StoreConfig
from moestream.store.executor import executor_for
from moestream.store.store import ExpertStore
from moestream.tracer import Tracer


def open_store(index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
               host_eviction: EvictionPolicy, integrity: Integrity | None = None,
               reader=None, link=None, tracer: Tracer | None = None) -> ExpertStore:
    """The store for config (see the module doc); the rest as ExpertStore takes them."""
    total = index.topology.total_expert_bytes
    host_bytes = config.host_budget.resolve(total)
    if merges_tiers(config.device, config.asynchronous, config.keep_host_tier) and host_bytes:
        config = dataclasses.replace(config, host_budget=Budget(size_bytes=0),
                                     device_budget=Budget(size_bytes=config.device_budget.resolve(total) + host_bytes))
    return ExpertStore(index, config, device_eviction, host_eviction, integrity, reader=reader, link=link,
                       executor=executor_for(config), tracer=tracer)


def merges_tiers(device: str, asynchronous: bool, keep_host_tier: bool = False) -> bool:
    """Whether the host budget joins the device tier: an asynchronous CPU store without a host tier kept apart."""
    return asynchronous and not device.startswith("cuda") and not keep_host_tier
