import threading
import time
from functools import partial

import pytest
import torch

from moestream.checkpoint.layout import Segment
from moestream.store.copies import read_round
from moestream.store.executor import ThreadedExecutor
from moestream.store.pool import SlotPool
from moestream.store.streams import CpuLink
from moestream.store.transfer import DISK, LinkReports, Transfer, TransferError, TransferLink, TransferQueue, pieces
from moestream.topology import ExpertKey
from moestream.tracer import Tracer

K = ExpertKey


def transfer(key, num_chunks=1, at=0, **kwargs):
    slot = torch.zeros(num_chunks, dtype=torch.uint8)
    return Transfer(key, slot, pieces([Segment("f", at + 100 * i, 1) for i in range(num_chunks)], 0), **kwargs)


def direct_reads(read, held):
    """The disk link's copy function, reading straight into the slots (no staging slots)."""
    return read_round(read, SlotPool(0, 1), CpuLink(torch.device("cpu")), held)


def start_link(cond, queue, read, reports, max_chunks, lane=DISK, move=direct_reads):
    """The link's rounds on a worker thread, as the asynchronous store runs them; returns (executor, tracer)."""
    tracer = Tracer()
    executor = ThreadedExecutor(max_chunks, timeout_s=5.0)
    executor.start(cond, [TransferLink(lane, queue, partial(move, read), reports)], tracer)
    return executor, tracer


def offsets(batch):
    """The file offsets a read batch asks for, chunk by chunk."""
    return [segment.offset for segments, _ in batch for segment in segments]


def test_demand_comes_first_in_order_asked_then_speculative_by_priority():
    queue = TransferQueue(capacity=8)
    for key, priority in [(K(0, 0), 0.1), (K(0, 1), 0.9), (K(0, 2), 0.5)]:
        queue.push(transfer(key, priority=priority))
    queue.push(transfer(K(1, 0), demand=True))
    queue.push(transfer(K(1, 1), demand=True))
    assert [queue.pop().key for _ in range(5)] == [K(1, 0), K(1, 1), K(0, 1), K(0, 2), K(0, 0)]
    assert queue.pop() is None


def test_requests_are_reprioritised_and_cancelled():
    queue = TransferQueue(capacity=8)
    low, high = transfer(K(0, 0), priority=0.1), transfer(K(0, 1), priority=0.9)
    queue.push(low)
    queue.push(high)
    queue.reprioritise(low, priority=1.0)
    assert queue.head_rank() == low.rank
    queue.reprioritise(high, demand=True)
    assert queue.cancel(K(0, 0)) is low and K(0, 0) not in queue and len(queue) == 1
    assert queue.speculative() == []
    assert queue.pop() is high and high.demand


def test_the_queue_is_bounded():
    queue = TransferQueue(capacity=1)
    queue.push(transfer(K(0, 0)))
    with pytest.raises(TransferError, match="holds 1"):
        queue.push(transfer(K(0, 1)))


def test_repeated_reprioritising_keeps_the_heap_bounded_and_the_order_right():
    queue = TransferQueue(capacity=4)
    transfers = [transfer(K(0, e), priority=0.0) for e in range(4)]
    for t in transfers:
        queue.push(t)
    for step in range(1000):
        queue.reprioritise(transfers[step % 4], priority=float(step))
    assert len(queue._heap) <= 2 * 4 + 16
    assert [queue.pop().key for _ in range(4)] == [K(0, 3), K(0, 2), K(0, 1), K(0, 0)]


def test_chunks_cover_the_slot_by_matrix_or_by_size():
    slot = torch.arange(10, dtype=torch.uint8)
    segments = [Segment("a", 0, 6), Segment("b", 50, 4)]
    by_matrix = pieces(segments, 0)
    assert [segment.nbytes for segment, _ in by_matrix] == [6, 4]
    by_size = pieces(segments, 4)
    assert [(s.file, s.offset, s.nbytes, at) for s, at in by_size] == [("a", 0, 4, 0), ("a", 4, 2, 4), ("b", 50, 4, 6)]
    moving = Transfer(K(0, 0), slot, by_size)
    assert moving.piece(3) == (tuple(s for s, _ in by_size), slice(0, 10))  # the chunks tile the slot
    moving.next_chunk = 1
    assert moving.piece(2) == ((Segment("a", 4, 2), Segment("b", 50, 4)), slice(4, 10))


def test_a_demand_waits_at_most_one_chunk_behind_speculative_work():
    cond, queue, reads, landed = threading.Condition(threading.RLock()), TransferQueue(8), [], []
    started = threading.Event()

    def read(batch):
        reads.extend(offsets(batch))
        started.set()
        time.sleep(0.01)
        return 1

    reports = LinkReports(landed=lambda t: landed.append(t.key), failed=lambda t, e: None)
    executor, _ = start_link(cond, queue, read, reports, max_chunks=1)
    speculative = transfer(K(0, 0), num_chunks=6, priority=1.0)
    with cond:
        queue.push(speculative)
        cond.notify_all()
    started.wait(5)
    with cond:
        queue.push(transfer(K(1, 0), at=7, demand=True))
        before = len(reads)
    deadline = time.time() + 5
    while len(landed) < 2 and time.time() < deadline:
        time.sleep(0.01)
    executor.stop()
    assert landed == [K(1, 0), K(0, 0)]
    assert reads.index(7) - before <= 1  # the demand's chunk came at most one chunk later
    assert sorted(reads) == [0, 7, 100, 200, 300, 400, 500]


def test_a_failed_read_is_reported_and_the_worker_goes_on():
    cond, queue, failed, landed = threading.Condition(threading.RLock()), TransferQueue(8), [], []

    def read(batch):
        if batch[0][0][0].file == "bad":
            raise OSError("injected")
        return 1

    reports = LinkReports(landed=lambda t: landed.append(t.key), failed=lambda t, e: failed.append((t.key, e)))
    executor, _ = start_link(cond, queue, read, reports, max_chunks=1)
    bad = Transfer(K(0, 0), torch.zeros(1, dtype=torch.uint8), pieces([Segment("bad", 0, 1)], 0))
    with cond:
        queue.push(bad)
        queue.push(transfer(K(0, 1)))
        cond.notify_all()
    deadline = time.time() + 5
    while len(landed) + len(failed) < 2 and time.time() < deadline:
        time.sleep(0.01)
    executor.stop()
    assert landed == [K(0, 1)] and failed[0][0] == K(0, 0) and "injected" in str(failed[0][1])


def test_demand_transfers_are_read_whole_together_and_speculation_in_rounds():
    cond, queue, batches = threading.Condition(threading.RLock()), TransferQueue(8), []
    gate = threading.Event()

    def read(batch):
        gate.wait(5)
        batches.append(sorted(offsets(batch)))
        return 1

    with cond:
        queue.push(transfer(K(0, 0), num_chunks=3, priority=0.5))
        queue.push(transfer(K(0, 1), num_chunks=3, at=1000, priority=0.9))
        queue.push(transfer(K(1, 0), num_chunks=2, at=5000, demand=True))
        queue.push(transfer(K(1, 1), num_chunks=2, at=7000, demand=True))
    landed = []
    reports = LinkReports(landed=lambda t: landed.append(t.key), failed=lambda t, e: None)
    executor, tracer = start_link(cond, queue, read, reports, max_chunks=4)
    gate.set()
    deadline = time.time() + 5
    while len(landed) < 4 and time.time() < deadline:
        time.sleep(0.01)
    executor.stop()
    assert batches == [[5000, 5100, 7000, 7100], [0, 1000, 1100, 1200], [100, 200]]
    assert landed == [K(1, 0), K(1, 1), K(0, 1), K(0, 0)] and tracer.totals()[DISK].spans == 3  # rounds
