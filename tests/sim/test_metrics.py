"""Derived figures from the counters."""

from moestream.bench.sim.metrics import LayerCounts, MoeBeyondCounters, StreamCounters


def test_stream_summary_derives_ratios():
    counters = StreamCounters(LayerCounts(2, hits=[3, 1], accesses=[4, 4]))
    counters.num_tokens, counters.num_iterations = 4, 4
    counters.sim_ms, counters.resident_ms, counters.stall_ms = 30.0, 20.0, 10.0
    counters.prefetches_admitted, counters.prefetches_started, counters.prefetches_landed = 2, 4, 2
    counters.late_prefetches, counters.wasted_prefetches = 1, 1
    counters.bytes_by_link = {"host_to_device": 400}
    m = counters.summary("host_to_device")
    assert m["hit_rate"] == 0.5 and m["per_layer_hit_rate"] == [0.75, 0.25]
    assert (m["stall_ms_per_token"], m["tpot_ms"], m["tpot_ratio_vs_resident"]) == (2.5, 7.5, 1.5)
    assert (m["bytes_per_token"], m["late_prefetch_ratio"], m["wasted_prefetch_ratio"]) == (100.0, 0.25, 0.5)


def test_empty_runs_give_zero_rates_not_errors():
    assert StreamCounters(LayerCounts(3)).summary("host_to_device")["hit_rate"] == 0.0
    assert MoeBeyondCounters(LayerCounts(3)).summary()["hit_rate"] == 0.0
