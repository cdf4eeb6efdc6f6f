import math

import pytest

from moestream.store.bandwidth import expert_stream_bandwidth, sequential_read_bandwidth


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
