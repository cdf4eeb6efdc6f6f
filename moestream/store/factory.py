"""Which expert store serves a configuration: its tiers, and where its transfers run.

`open_store` makes the one `ExpertStore` with the executor that `executor_for` picks: inline on the
caller's thread unless the configuration asks for asynchronous transfers, then on link workers. Its
links follow its tiers (disk -> device, or disk -> host -> device where a host tier is kept apart).
On the CPU, host and device memory are the same: there an asynchronous store's host budget joins the
device tier (one tier, each expert held once, no second copy). This module knows no policy.
"""

from __future__ import annotations

import dataclasses

from moestream.checkpoint.layout import ExpertIndex, Integrity
from moestream.contracts import EvictionPolicy
from moestream.store.config import Budget, StoreConfig
from moestream.store.executor import executor_for
from moestream.store.store import ExpertStore
from moestream.topology import Topology
from moestream.tracer import Tracer


def open_store(index: ExpertIndex, config: StoreConfig, device_eviction: EvictionPolicy,
               host_eviction: EvictionPolicy, integrity: Integrity | None = None,
               reader=None, link=None, tracer: Tracer | None = None) -> ExpertStore:
    """The store for config (see the module doc), with its tiers' eviction policies; reader, link and
    tracer: as ExpertStore takes them."""
    if merges_tiers(config.device, config.asynchronous, config.keep_host_tier):
        config = one_tier(config, index.topology)
    return ExpertStore(index, config, device_eviction, host_eviction, integrity, reader=reader, link=link,
                       executor=executor_for(config), tracer=tracer)


def merges_tiers(device: str, asynchronous: bool, keep_host_tier: bool = False) -> bool:
    """Whether the store holds its host budget in the device tier: an asynchronous store on the CPU, unless
    it keeps a host tier apart (experts computed where their host bytes are)."""
    return asynchronous and not device.startswith("cuda") and not keep_host_tier


def one_tier(config: StoreConfig, topology: Topology) -> StoreConfig:
    """The configuration with the host budget moved into the device tier."""
    host_bytes = config.host_budget.resolve(topology.total_expert_bytes)
    if not host_bytes:
        return config
    device_bytes = config.device_budget.resolve(topology.total_expert_bytes)
    return dataclasses.replace(config, device_budget=Budget(size_bytes=device_bytes + host_bytes),
                               host_budget=Budget(size_bytes=0))
