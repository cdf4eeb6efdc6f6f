"""The expert store's counters, as one plain dataclass (a copy per call).

hits, prefetch_hits, prefetch_wasted and the device tier's evictions come from the transfer core's
counts (`moestream.transfer_core`); the times from the tracer's lanes (`moestream.tracer`); the rest
the store counts itself. Knows no store."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moestream.read_fit import ReadBatchFit


@dataclass
class StoreStats:
    hits: int = 0  # acquire: experts in the device tier (their bytes landed or still moving: late)
    misses: int = 0  # acquire: experts not in the device tier, fetched on demand
    host_hits: int = 0  # device fills served by the host tier
    host_misses: int = 0  # device fills served by disk
    bytes_read: dict[str, int] = field(default_factory=lambda: {"disk": 0, "host": 0})  # read (checked), copied up
    prefetched: int = 0  # experts brought into the device tier by prefetch
    prefetched_bytes: int = 0
    prefetch_hits: int = 0  # acquire hits on prefetched experts landed and not used before (never a late one)
    prefetch_wasted: int = 0  # prefetched experts evicted before any acquire used them
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    disk_read_s: float = 0.0  # wall time of the disk reads (a batch's requests in flight together count once)
    disk_batches: int = 0  # rounds of disk reads (each in flight together)
    read_fit: ReadBatchFit = field(default_factory=ReadBatchFit)  # the disk link's rounds: experts, seconds
    stall_s: float = 0.0  # time the calling (compute) thread waited for expert bytes (or moved them, inline)
    transfer_s: float = 0.0  # time the disk link was busy
    copy_s: float = 0.0  # time the host -> device link was busy (a host tier kept apart)
    late: int = 0  # fetched experts whose bytes were still in flight (counted in hits: their wait is stall)
    cancelled: int = 0  # queued speculative transfers dropped before they ran

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def copy(self) -> "StoreStats":
        return dataclasses.replace(self, bytes_read=dict(self.bytes_read), evictions=dict(self.evictions),
                                   read_fit=dataclasses.replace(self.read_fit))
