"""Server metrics: store statistics are cumulative and counted once; gauges read the worker live."""

import pytest

from moestream.serving.metrics import ServerMetrics
from moestream.store.store import StoreStats


def _value(metrics: ServerMetrics, line_start: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.render().decode().splitlines() if line.startswith(line_start))


def test_cumulative_store_statistics_are_counted_once():
    metrics = ServerMetrics(lambda: 3, lambda: 2, lambda: 4096)
    metrics.observe_store(StoreStats(hits=2, misses=1, bytes_read={"disk": 100, "host": 0}))
    metrics.observe_store(StoreStats(hits=5, misses=1, bytes_read={"disk": 300, "host": 0}, prefetched=4, prefetch_hits=1))
    assert _value(metrics, 'moestream_expert_lookups_total{result="hit",tier="device"}') == 5
    assert _value(metrics, 'moestream_expert_lookups_total{result="miss",tier="device"}') == 1
    assert _value(metrics, 'moestream_expert_bytes_moved_total{source="disk"}') == 300
    assert _value(metrics, "moestream_prefetch_precision") == 0.25
    assert _value(metrics, "moestream_queue_depth") == 3
    assert _value(metrics, "moestream_running_sequences") == 2
    assert _value(metrics, "moestream_kv_reserved_bytes") == 4096


def test_statistics_reset_between_observations_count_from_zero():
    metrics = ServerMetrics(lambda: 0, lambda: 0, lambda: 0)
    metrics.observe_store(StoreStats(hits=7, misses=3, bytes_read={"disk": 500, "host": 0}))
    metrics.observe_store(StoreStats(hits=2, misses=1, bytes_read={"disk": 40, "host": 0}))  # reset, then 2 / 1 more
    assert _value(metrics, 'moestream_expert_lookups_total{result="hit",tier="device"}') == 9
    assert _value(metrics, 'moestream_expert_lookups_total{result="miss",tier="device"}') == 4
    assert _value(metrics, 'moestream_expert_bytes_moved_total{source="disk"}') == 540


def test_host_tier_lookups_and_prefetch_recall_are_reported():
    metrics = ServerMetrics(lambda: 0)
    stats = StoreStats(hits=6, misses=2, host_hits=3, host_misses=1, bytes_read={"disk": 10, "host": 30},
                       prefetched=5, prefetch_hits=4)
    metrics.observe_store(stats)
    assert _value(metrics, 'moestream_expert_lookups_total{result="hit",tier="host"}') == stats.host_hits
    assert _value(metrics, 'moestream_expert_lookups_total{result="miss",tier="host"}') == stats.host_misses
    assert _value(metrics, 'moestream_expert_bytes_moved_total{source="host"}') == stats.bytes_read["host"]
    used = stats.prefetch_hits  # needed experts prefetch brought in, of those not resident before
    assert _value(metrics, "moestream_prefetch_recall") == pytest.approx(used / (used + stats.misses))


def test_misses_computed_on_the_host_are_counted_with_their_share_of_all_misses():
    metrics = ServerMetrics(lambda: 0)
    metrics.observe_store(StoreStats(hits=4, misses=3), host_computed=1)
    metrics.observe_store(StoreStats(hits=8, misses=4), host_computed=2)  # 1 more fetched, 2 more on the host
    assert _value(metrics, "moestream_experts_host_computed_total") == 3
    assert _value(metrics, "moestream_host_compute_share") == pytest.approx(3 / (3 + 4))
    metrics.observe_store(StoreStats(hits=1, misses=1))  # reset in between: one more fetched, none on the host
    assert metrics.num_host_computed == 3 and metrics.host_share() == pytest.approx(3 / 8)
    assert ServerMetrics(lambda: 0).host_share() is None  # no miss yet
