import errno
import fcntl
import logging
import os

import numpy as np
import pytest
import torch

from moestream.checkpoint.layout import Segment
from moestream.errors import CheckpointError
from moestream.store.disk import DiskReader, coalesce_batch, split
from moestream.topology import ExpertKey

FILE_BYTES = 50_000


@pytest.fixture
def data_files(tmp_path):
    rng = np.random.default_rng(0)
    files = {}
    for name in ("a.bin", "b.bin"):
        data = rng.integers(0, 256, FILE_BYTES, dtype=np.uint8)
        (tmp_path / name).write_bytes(data.tobytes())
        files[tmp_path / name] = data
    return files


def expected_bytes(files, segments):
    return np.concatenate([files[s.file][s.offset : s.offset + s.nbytes] for s in segments])


def read(reader, segments):
    dst = torch.zeros(sum(s.nbytes for s in segments) + 5, dtype=torch.uint8)
    assert reader.read(segments, dst) == dst.numel() - 5
    assert not dst[-5:].any()  # nothing written past the segments
    return dst[:-5].numpy()


def direct_io_works(path) -> bool:
    with DiskReader() as reader:
        return reader.is_direct(path)


SEGMENT_CASES = {
    "aligned": [(0, 4096, 8192)],
    "unaligned": [(0, 5, 100)],
    "spans_chunks": [(0, 1000, 30_000)],
    "end_of_file": [(0, FILE_BYTES - 7, 7)],
    "out_of_file_order": [(0, 20_000, 300), (0, 100, 50), (1, 7, 4096)],
    "adjacent": [(1, 100, 10), (1, 110, 20), (1, 130, 5000)],
}


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("case", sorted(SEGMENT_CASES))
def test_reader_returns_exactly_the_segment_bytes(data_files, case, direct_io):
    paths = sorted(data_files)
    segments = [Segment(paths[f], off, n) for f, off, n in SEGMENT_CASES[case]]
    with DiskReader(direct_io=direct_io, staging_bytes=8192) as reader:
        got = read(reader, segments)
        assert np.array_equal(got, expected_bytes(data_files, segments))
        assert reader.stats.bytes_read == got.size
        assert reader.stats.bytes_fetched >= got.size
        if reader.is_direct(paths[0]) and case != "end_of_file":
            assert reader.stats.bytes_fetched % 4096 == 0


def test_coalesce_merges_file_adjacent_segments_whatever_their_slot_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    segs = [Segment(a, 200, 100), Segment(a, 0, 200), Segment(b, 0, 10), Segment(a, 300, 50)]
    runs = coalesce_batch([segs])
    assert [(r.file, r.start, r.end) for r in runs] == [(a, 0, 350), (b, 0, 10)]
    dst_offsets = {p.file_offset: p.dst_offset for p in runs[0].pieces}
    assert dst_offsets == {200: 0, 0: 100, 300: 310}


def test_coalesce_splits_on_gaps_beyond_the_limit(tmp_path):
    a = tmp_path / "a"
    segs = [Segment(a, 0, 100), Segment(a, 150, 100), Segment(a, 5000, 10)]
    assert len(coalesce_batch([segs], max_gap_bytes=0)) == 3
    assert len(coalesce_batch([segs], max_gap_bytes=50)) == 2
    assert len(coalesce_batch([segs], max_gap_bytes=4900)) == 1


def test_an_expert_of_adjacent_segments_is_one_syscall(data_files):
    path = sorted(data_files)[0]
    segments = [Segment(path, 300, 1000), Segment(path, 1300, 2000), Segment(path, 3300, 700)]
    with DiskReader() as reader:
        read(reader, segments)
        assert reader.stats.num_reads == 1


@pytest.mark.parametrize("num_workers", [1, 4])
@pytest.mark.parametrize("direct_io", [True, False])
def test_a_batch_fills_every_destination_with_its_own_bytes(data_files, num_workers, direct_io):
    paths = sorted(data_files)
    batch = [[Segment(paths[0], 9000, 7000), Segment(paths[1], 100, 30)],
             [Segment(paths[0], 16_000, 5000)],  # adjacent to the first destination's segment
             [Segment(paths[1], 40_000, 9999), Segment(paths[0], 3, 4)]]
    dsts = [torch.zeros(sum(s.nbytes for s in segs) + 3, dtype=torch.uint8) for segs in batch]
    with DiskReader(direct_io=direct_io, staging_bytes=8192, num_workers=num_workers) as reader:
        assert reader.read_batch(list(zip(batch, dsts))) == sum(d.numel() - 3 for d in dsts)
        assert reader.stats.num_reads > len(batch)  # cut into requests of at most 8192 bytes
    for segs, dst in zip(batch, dsts):
        assert np.array_equal(dst[:-3].numpy(), expected_bytes(data_files, segs))
        assert not dst[-3:].any()


def test_coalesce_batch_merges_adjacent_segments_of_different_destinations(tmp_path):
    a = tmp_path / "a"
    runs = coalesce_batch([[Segment(a, 100, 50)], [Segment(a, 0, 100), Segment(a, 500, 10)]])
    assert [(r.start, r.end) for r in runs] == [(0, 150), (500, 510)]
    assert [(p.file_offset, p.dst, p.dst_offset) for p in runs[0].pieces] == [(0, 1, 0), (100, 0, 0)]
    assert [(p.dst, p.dst_offset) for p in runs[1].pieces] == [(1, 100)]


def test_split_covers_the_aligned_run_in_bounded_requests(tmp_path):
    (run,) = coalesce_batch([[Segment(tmp_path / "a", 5000, 20_000)]])
    requests = split(run, align=4096, max_bytes=8192)
    assert [(r.start, r.nbytes) for r in requests] == [(4096, 8192), (12288, 8192), (20480, 8192)]
    assert requests[-1].start + requests[-1].nbytes >= run.end


def test_requests_are_at_most_one_staging_buffer(data_files):
    path = sorted(data_files)[0]
    with DiskReader(staging_bytes=8192, num_workers=4) as reader:
        reader.read([Segment(path, 0, 40_000)], torch.empty(40_000, dtype=torch.uint8))
        assert reader.stats.num_reads == 5  # 40 000 bytes in requests of 8192 (aligned out)
        assert reader.stats.bytes_read == 40_000


def test_reader_matches_safetensors_own_load(checkpoint):
    index = checkpoint.index
    with DiskReader() as reader:
        for key in (ExpertKey(0, 0), ExpertKey(0, 3), ExpertKey(1, 2)):
            slot = torch.empty(index.topology.expert_bytes, dtype=torch.uint8)
            reader.read(index.locations[key].segments, slot)
            for name, tensor in checkpoint.expected(key).items():
                assert torch.equal(index.views(slot)[name], tensor)


def test_direct_io_is_used_where_the_filesystem_allows_and_forced_off_by_flag(data_files):
    path = sorted(data_files)[0]
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this system")
    with DiskReader(direct_io=True) as reader:
        fd = reader._handle(path).fd
        assert reader.is_direct(path) == bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    with DiskReader(direct_io=False) as reader:
        assert not reader.is_direct(path)
        assert not fcntl.fcntl(reader._handle(path).fd, fcntl.F_GETFL) & os.O_DIRECT


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_fallback_when_open_refuses_o_direct_logs_once(data_files, monkeypatch, caplog):
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    paths = sorted(data_files)
    segments = [Segment(paths[0], 10, 5000), Segment(paths[1], 4096, 4096)]
    with caplog.at_level(logging.WARNING, logger="moestream.store.disk"), DiskReader() as reader:
        assert np.array_equal(read(reader, segments), expected_bytes(data_files, segments))
        assert not reader.is_direct(paths[0]) and not reader.is_direct(paths[1])
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_fallback_when_the_first_direct_read_fails(data_files, monkeypatch):
    path = sorted(data_files)[0]
    if not direct_io_works(path):
        pytest.skip("this filesystem refuses O_DIRECT at open")
    _refuse_direct_reads(monkeypatch)
    segments = [Segment(path, 123, 20_000)]
    with DiskReader() as reader:
        assert np.array_equal(read(reader, segments), expected_bytes(data_files, segments))
        assert not reader.is_direct(path)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_parallel_requests_fall_back_together_when_direct_reads_fail(data_files, monkeypatch):
    path = sorted(data_files)[0]
    if not direct_io_works(path):
        pytest.skip("this filesystem refuses O_DIRECT at open")
    _refuse_direct_reads(monkeypatch)
    segments = [Segment(path, 123, 40_000)]
    with DiskReader(staging_bytes=4096, num_workers=4) as reader:
        assert np.array_equal(read(reader, segments), expected_bytes(data_files, segments))
        assert not reader.is_direct(path)


@pytest.mark.parametrize("num_workers", [1, 4])
def test_a_failed_request_fails_the_batch(data_files, num_workers):
    path = sorted(data_files)[0]
    batch = [([Segment(path, 0, 20_000)], torch.empty(20_000, dtype=torch.uint8)),
             ([Segment(path, FILE_BYTES - 10, 20)], torch.empty(20, dtype=torch.uint8))]
    with DiskReader(staging_bytes=4096, num_workers=num_workers) as reader, \
            pytest.raises(CheckpointError, match="ends at byte"):
        reader.read_batch(batch)


@pytest.mark.parametrize("direct_io", [True, False])
def test_reading_past_the_end_is_a_checkpoint_error(data_files, direct_io):
    path = sorted(data_files)[0]
    with DiskReader(direct_io=direct_io) as reader, pytest.raises(CheckpointError, match="ends at byte"):
        read(reader, [Segment(path, FILE_BYTES - 10, 20)])


def test_missing_file_is_a_checkpoint_error(tmp_path):
    with DiskReader() as reader, pytest.raises(CheckpointError, match="missing"):
        read(reader, [Segment(tmp_path / "nope.safetensors", 0, 10)])


def test_destination_must_be_a_large_enough_cpu_byte_tensor(data_files):
    path = sorted(data_files)[0]
    with DiskReader() as reader, pytest.raises(ValueError):
        reader.read([Segment(path, 0, 100)], torch.empty(99, dtype=torch.uint8))


def test_close_releases_file_descriptors(data_files):
    path = sorted(data_files)[0]
    reader = DiskReader()
    read(reader, [Segment(path, 0, 10)])
    fd = reader._handle(path).fd
    reader.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def _refuse_direct_reads(monkeypatch):
    """Reads through an O_DIRECT descriptor fail with EINVAL, as on filesystems that refuse them."""
    real_preadv = os.preadv

    def refuse_direct(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", refuse_direct)


def _congruent(nbytes, file_offset):
    """A zeroed uint8 tensor whose first byte is congruent to file_offset modulo the block."""
    raw = torch.zeros(nbytes + 3 * 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096 + file_offset % 4096
    return raw[start : start + nbytes]


@pytest.mark.parametrize("direct_io", [True, False])
def test_congruent_destinations_take_whole_blocks_without_staging(data_files, direct_io):
    path = sorted(data_files)[0]
    # one expert whose parts are back to back in the file in the other order than in its slot; the
    # parts' sizes sum to whole blocks, so one placement makes both congruent
    segments = [Segment(path, 15_000, 6384), Segment(path, 5000, 10_000)]
    raw = _congruent(16_384 + 4096, 15_000)
    dst = raw[:16_384]
    with DiskReader(direct_io=direct_io) as reader:
        reader.read(segments, dst)
        assert np.array_equal(dst.numpy(), expected_bytes(data_files, segments))
        assert not raw[16_384:].any()  # nothing written past the destination
        assert reader.stats.num_reads == 1  # one vectored read for both parts
        whole_blocks = 4096 + 4096  # [8192, 12288) of the first part, [16384, 20480) of the second
        assert reader.stats.direct_bytes == (whole_blocks if reader.is_direct(path) else 16_384)


@pytest.mark.parametrize("direct_io", [True, False])
def test_short_reads_are_resumed_where_they_stopped(data_files, monkeypatch, direct_io):
    real_preadv = os.preadv

    def at_most_5000_bytes(fd, buffers, offset, *args):
        kept, room = [], 5000 if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else 8192
        for buffer in buffers:
            if room <= 0:
                break
            kept.append(buffer[:room])
            room -= len(kept[-1])
        return real_preadv(fd, kept, offset, *args)

    monkeypatch.setattr(os, "preadv", at_most_5000_bytes)
    path = sorted(data_files)[0]
    segments = [Segment(path, 5000, 30_000)]
    with DiskReader(direct_io=direct_io) as reader:
        dst = _congruent(30_000, 5000)
        reader.read(segments, dst)
        assert np.array_equal(dst.numpy(), expected_bytes(data_files, segments))
        assert reader.stats.num_reads > 3
