import math

import pytest

from moestream.bench.tools.bandwidth import (
    COLD_READ_METHODS,
    LAYERS_PER_PASS,
    ColdReadLog,
    cold_read_samples,
    drop_page_cache,
    expert_stream_bandwidth,
    layer_pass,
    random_experts,
    sequential_read_bandwidth,
)
from moestream.errors import CheckpointError
from moestream.topology import ExpertKey
from tests.store.conftest import TinyCheckpoint, write_checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> TinyCheckpoint:
    return write_checkpoint(tmp_path)


@pytest.mark.parametrize("direct_io", [True, False])
def test_sequential_bandwidth_is_a_positive_rate(tmp_path, direct_io):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 1000)
    rate = sequential_read_bandwidth(path, block_bytes=10_000, direct_io=direct_io)
    assert rate > 0 and math.isfinite(rate)
    assert sequential_read_bandwidth(path, nbytes=5000, block_bytes=4096) > 0


def test_parallel_sequential_bandwidth_is_a_positive_rate(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 1000)
    rate = sequential_read_bandwidth(path, block_bytes=65536, request_bytes=8192, num_workers=4)
    assert rate > 0 and math.isfinite(rate)


@pytest.mark.parametrize("batch", [1, 3])
def test_expert_stream_bandwidth_reads_the_locations(checkpoint, batch):
    locations = list(checkpoint.index.locations.values())
    assert expert_stream_bandwidth(locations, batch=batch) > 0
    with pytest.raises(ValueError):
        expert_stream_bandwidth([])


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="nothing to read"):
        sequential_read_bandwidth(path)


def test_layer_pass_reads_every_expert_of_consecutive_layers_in_order(checkpoint):
    index = checkpoint.index
    topology = index.topology
    for seed in range(3):
        locations = layer_pass(index, seed)
        layers = min(LAYERS_PER_PASS, topology.num_layers)
        first = seed * LAYERS_PER_PASS % topology.num_layers
        expected = [ExpertKey((first + i) % topology.num_layers, e) for i in range(layers)
                    for e in range(topology.num_experts)]
        assert locations == [index.locations[key] for key in expected]


def test_random_experts_are_distinct_within_a_batch_and_seeded(checkpoint):
    index = checkpoint.index
    k = min(index.topology.top_k, index.topology.num_experts)
    locations = random_experts(index, seed=5)
    assert locations == random_experts(index, seed=5)
    for i in range(0, len(locations), k):
        batch = locations[i : i + k]
        assert len({id(loc) for loc in batch}) == len(batch)


@pytest.mark.parametrize("direct_io", [True, False])
def test_cold_read_samples_give_a_rate_per_method(checkpoint, direct_io):
    rates = cold_read_samples(checkpoint.files[0], checkpoint.index, seed=1, direct_io=direct_io)
    assert tuple(rates) == COLD_READ_METHODS
    assert all(rate > 0 and math.isfinite(rate) for rate in rates.values())


def test_cold_read_log_keeps_samples_in_order(checkpoint):
    log = ColdReadLog()
    for seed in range(2):
        log.take(checkpoint.files[0], checkpoint.index, seed, direct_io=False)
    assert tuple(log.rates) == COLD_READ_METHODS
    assert all(len(rates) == 2 and min(rates) > 0 for rates in log.rates.values())
    assert log.reference() == max(log.medians()["sequential"], log.medians()["sequential_reader"])


def test_cold_read_log_reference_around_a_run_is_the_mean_of_its_neighbours():
    log = ColdReadLog()
    log.rates["sequential"] = [1.0, 4.0, 2.0]
    log.rates["sequential_reader"] = [3.0, 2.5, 1.0]
    assert log.reference_around(0) == pytest.approx((3.0 + 4.0) / 2)
    assert log.reference_around(1) == pytest.approx((4.0 + 2.0) / 2)
    assert log.reference_around(2) == pytest.approx(2.0)
    assert log.reference() == pytest.approx(2.5)  # the better median: max(2.0, 2.5)
    with pytest.raises(ValueError, match="position 3"):
        log.reference_around(3)


def test_drop_page_cache_leaves_files_intact_and_names_a_missing_one(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 64)
    drop_page_cache([path])
    assert path.read_bytes() == bytes(range(256)) * 64
    with pytest.raises(CheckpointError, match="gone.bin"):
        drop_page_cache([path, tmp_path / "gone.bin"])
