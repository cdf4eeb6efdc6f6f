"""The server's Prometheus metrics, in a registry of its own: latencies, queue, batches, KV, the store's lookups and
bytes, prefetch precision/recall and misses computed on the host. Knows no HTTP route or policy."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int] = lambda: 0,
                 kv_reserved_bytes: Callable[[], int] = lambda: 0):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("moestream_ttft_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("moestream_tpot_seconds", "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.batch_size = Histogram("moestream_batch_size", "Sequences per engine batch", buckets=BATCH_BUCKETS, registry=r)
        self.requests = Counter("moestream_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("moestream_rejected_requests", "Requests refused because the queue was full", registry=r)
        self.tokens = Counter("moestream_generated_tokens", "Generated tokens", registry=r)
        self.lookups = Counter("moestream_expert_lookups", "Expert lookups by tier and result", ["tier", "result"], registry=r)
        self.bytes_moved = Counter("moestream_expert_bytes_moved", "Expert bytes copied up, by source", ["source"], registry=r)
        self.prefetched = Counter("moestream_experts_prefetched", "Experts brought in by prefetch", registry=r)
        self.prefetch_hits = Counter("moestream_prefetch_hits", "Lookups that hit a prefetched expert", registry=r)
        self.prefetch_precision = Gauge("moestream_prefetch_precision", "Prefetched experts later used / prefetched", registry=r)
        self.prefetch_recall = Gauge("moestream_prefetch_recall",
                                     "Needed experts that prefetch brought in / needed experts not resident before", registry=r)
        self.host_computed = Counter("moestream_experts_host_computed", "Device-tier misses computed on the host "
                                     "from their host slots (--host-compute)", registry=r)
        self.host_compute_share = Gauge("moestream_host_compute_share", "Device-tier misses computed on the host / "
                                        "all device-tier misses (those computed there and those fetched)", registry=r)
        Gauge("moestream_queue_depth", "Requests waiting for the engine", registry=r).set_function(queue_depth)
        Gauge("moestream_running_sequences", "Sequences admitted and not ended", registry=r).set_function(running)
        Gauge("moestream_kv_reserved_bytes", "KV cache bytes reserved by the running sequences",
              registry=r).set_function(kv_reserved_bytes)
        self._last = None  # the store statistics seen last
        self._misses = 0  # device-tier misses fetched, all observed (the store's count may be reset)
        self.num_host_computed = 0  # device-tier misses computed on the host, all observed

    def observe_store(self, stats, host_computed: int = 0) -> None:
        """Adds what the store's cumulative StoreStats gained since the last call (all of a count that went
        down: reset in between); host_computed: misses computed on the host since the last call."""
        before, self._last = self._last, stats.copy()
        self._misses += gained(stats.misses, before.misses if before else 0)
        self.host_computed.inc(host_computed)
        self.num_host_computed += host_computed
        counters = {"hits": self.lookups.labels("device", "hit"), "misses": self.lookups.labels("device", "miss"),
                    "host_hits": self.lookups.labels("host", "hit"), "host_misses": self.lookups.labels("host", "miss"),
                    "prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits}
        for name, counter in counters.items():
            counter.inc(gained(getattr(stats, name), getattr(before, name) if before else 0))
        for source, count in stats.bytes_read.items():
            self.bytes_moved.labels(source).inc(gained(count, before.bytes_read.get(source, 0) if before else 0))
        prefetched, used, misses = stats.prefetched, stats.prefetch_hits, stats.misses
        self.prefetch_precision.set(used / prefetched if prefetched else 0.0)
        self.prefetch_recall.set(used / (used + misses) if used + misses else 0.0)
        self.host_compute_share.set(self.host_share() or 0.0)

    def host_share(self) -> float | None:
        """Device-tier misses computed on the host, of all observed (None: no miss yet)."""
        total = self.num_host_computed + self._misses
        return self.num_host_computed / total if total else None

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gained(now: int, before: int) -> int:
    return now - before if now >= before else now  # a count that went down was reset in between
