import numpy as np
import pytest

from moestream.checkpoint.layout import Segment
from moestream.store.disk import coalesce_batch, split
from moestream.store.scatter import IOV_MAX, scatter_plan

BLOCK = 4096


def aligned(nbytes, residue=0):
    """A zeroed uint8 array whose first byte sits at `residue` modulo the block."""
    raw = np.zeros(nbytes + 2 * BLOCK, dtype=np.uint8)
    start = (-raw.ctypes.data) % BLOCK + residue
    return raw[start : start + nbytes]


def run_plan(file_bytes, batch, dsts, align=BLOCK):
    """Plans every request of the batch and executes it against file_bytes (a stand-in for preadv)."""
    staging, direct = aligned(1 << 20), 0
    for run in coalesce_batch(batch, max_gap_bytes=BLOCK):
        for request in split(run, align, 1 << 20):
            plan = scatter_plan(request, dsts, staging, align)
            assert len(plan.buffers) <= IOV_MAX
            data, pos = file_bytes[request.start : request.start + request.nbytes], 0
            for buffer in plan.buffers:
                assert align == 1 or (np.frombuffer(buffer, np.uint8).ctypes.data % align, buffer.nbytes % align) == (0, 0)
                n = min(buffer.nbytes, data.size - pos)
                np.frombuffer(buffer, np.uint8)[:n] = data[pos : pos + n]
                pos += n
            assert pos == min(request.nbytes, data.size)
            plan.copy_out(staging, dsts)
            direct += plan.direct_bytes
    return direct


def expected(file_bytes, segments):
    return np.concatenate([file_bytes[s.offset : s.offset + s.nbytes] for s in segments])


@pytest.fixture
def file_bytes():
    return np.random.default_rng(1).integers(1, 256, 80_000, dtype=np.uint8)


def test_a_congruent_destination_takes_its_whole_blocks_in_place(file_bytes):
    seg = Segment("f", 5000, 20_000)
    dst = aligned(seg.nbytes + 7, residue=5000 % BLOCK)
    direct = run_plan(file_bytes, [[seg]], [dst])
    assert np.array_equal(dst[:-7], expected(file_bytes, [seg]))
    assert not dst[-7:].any()  # nothing written past the piece
    assert direct == 24_576 - 8192  # blocks 8192..24576 lie wholly inside the piece


def test_a_destination_that_is_not_congruent_goes_through_staging(file_bytes):
    seg = Segment("f", 5000, 20_000)
    dst = aligned(seg.nbytes, residue=(5000 + 16) % BLOCK)
    assert run_plan(file_bytes, [[seg]], [dst]) == 0
    assert np.array_equal(dst, expected(file_bytes, [seg]))


def test_pieces_sharing_blocks_in_slot_order_unlike_file_order(file_bytes):
    """An expert whose parts lie back to back in the file in another order than in its slot, beside
    a second expert that shares its boundary block: each gets exactly its bytes."""
    first = [Segment("f", 9000 + 12_288, 8192), Segment("f", 9000, 12_288)]
    second = [Segment("f", 9000 + 20_480, 6000)]
    dsts = [aligned(20_480, residue=(9000 + 12_288) % BLOCK), aligned(6000, residue=(9000 + 20_480) % BLOCK)]
    direct = run_plan(file_bytes, [first, second], dsts)
    assert np.array_equal(dsts[0], expected(file_bytes, first))
    assert np.array_equal(dsts[1], expected(file_bytes, second))
    assert direct > 0


def test_buffered_reads_land_every_byte_in_place(file_bytes):
    segs = [[Segment("f", 3, 10_001)], [Segment("f", 10_004, 99), Segment("f", 50_000, 17)]]
    dsts = [np.zeros(10_001, np.uint8), np.zeros(116, np.uint8)]
    assert run_plan(file_bytes, segs, dsts, align=1) == 10_001 + 99 + 17
    assert all(np.array_equal(d, expected(file_bytes, s)) for d, s in zip(dsts, segs))


def test_pieces_that_overlap_in_the_file_are_staged(file_bytes):
    segs = [[Segment("f", 0, 12_288)], [Segment("f", 4096, 8192)]]
    dsts = [aligned(12_288), aligned(8192)]
    assert run_plan(file_bytes, segs, dsts) == 0
    assert all(np.array_equal(d, expected(file_bytes, s)) for d, s in zip(dsts, segs))
