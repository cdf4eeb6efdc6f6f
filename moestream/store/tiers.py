"""The store's tiers of expert slots (`make_tiers`: the device tier and, where the budget buys slots, a host
tier), its staging slots, and the checks of what it is given. Knows no transfer, no thread and no policy.
"""

from __future__ import annotations

from typing import Sequence

from moestream.cache import ExpertCache
from moestream.checkpoint.layout import ExpertIndex
from moestream.contracts import EvictionPolicy
from moestream.errors import CheckpointError
from moestream.store.chain import Tier
from moestream.store.config import StoreConfig
from moestream.store.pool import SlotPool
from moestream.topology import ExpertKey, Topology

TIERS = ("device", "host")
STAGING_SLOTS = 8  # pinned slots between disk and a CUDA device tier when there is no host tier


def make_tiers(config: StoreConfig, topology: Topology, device_eviction: EvictionPolicy,
               host_eviction: EvictionPolicy) -> tuple[Tier, Tier | None]:
    """The device tier, and the host tier where config's host budget buys slots (else None)."""
    device_slots, host_slots = config.device_slots(topology), config.host_slots(topology)
    expert_bytes = topology.expert_bytes
    device = Tier(ExpertCache(device_slots, device_eviction), SlotPool(device_slots, expert_bytes, config.device))
    if not host_slots:
        return device, None
    pool = SlotPool(host_slots, expert_bytes, "cpu", pin_memory=config.uses_cuda)
    return device, Tier(ExpertCache(host_slots, host_eviction), pool)


def staging_slots(config: StoreConfig, topology: Topology, wanted: int = STAGING_SLOTS) -> int:
    """Pinned slots that disk reads are staged through: where a CUDA device tier has no host tier."""
    pinned_device = config.uses_cuda and not config.host_slots(topology)
    return min(wanted, config.device_slots(topology)) if pinned_device else 0


def as_key(key: Sequence[int]) -> ExpertKey:
    """An ExpertKey of plain ints (callers may pass numpy pairs)."""
    if type(key) is ExpertKey and type(key.layer) is int and type(key.expert) is int:
        return key
    return ExpertKey(int(key[0]), int(key[1]))


def check_index(index: ExpertIndex) -> None:
    """Every expert of the topology has a location of exactly expert_bytes."""
    topology = index.topology
    for key in topology.keys():
        location = index.locations.get(key)
        if location is None:
            raise CheckpointError(f"the expert index has no location for layer {key.layer} expert {key.expert}")
        if location.nbytes != topology.expert_bytes:
            raise CheckpointError(
                f"expert {tuple(key)} has {location.nbytes} bytes on disk, the topology says {topology.expert_bytes}"
            )
