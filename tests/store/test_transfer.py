import threading
import time

import pytest
import torch

from moestream.checkpoint.layout import Segment
from moestream.store.transfer import DiskWorker, LinkReports, Transfer, TransferError, TransferQueue, chunks_of
from moestream.topology import ExpertKey

K = ExpertKey


def transfer(key, num_chunks=1, at=0, **kwargs):
    slot = torch.zeros(num_chunks, dtype=torch.uint8)
    return Transfer(key, chunks_of([Segment("f", at + 100 * i, 1) for i in range(num_chunks)], slot, 0), **kwargs)


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
    by_matrix = chunks_of(segments, slot, 0)
    assert [c.segments[0].nbytes for c in by_matrix] == [6, 4]
    by_size = chunks_of(segments, slot, 4)
    assert [(c.segments[0].file, c.segments[0].offset, c.segments[0].nbytes) for c in by_size] == [
        ("a", 0, 4), ("a", 4, 2), ("b", 50, 4)]
    assert torch.equal(torch.cat([c.dst for c in by_size]), slot)


def test_a_demand_waits_at_most_one_chunk_behind_speculative_work():
    cond, queue, reads, landed = threading.Condition(threading.RLock()), TransferQueue(8), [], []
    started = threading.Event()

    def read(batch):
        reads.extend(segments[0].offset for segments, _ in batch)
        started.set()
        time.sleep(0.01)
        return 1

    reports = LinkReports(lambda t: landed.append(t.key), lambda t, e: None, lambda s: None)
    worker = DiskWorker(cond, queue, read, reports, max_chunks=1)
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
    worker.stop(5)
    assert landed == [K(1, 0), K(0, 0)]
    assert reads.index(7) - before <= 1  # the demand's chunk came at most one chunk later
    assert sorted(reads) == [0, 7, 100, 200, 300, 400, 500]


def test_a_failed_read_is_reported_and_the_worker_goes_on():
    cond, queue, failed, landed = threading.Condition(threading.RLock()), TransferQueue(8), [], []

    def read(batch):
        if batch[0][0][0].file == "bad":
            raise OSError("injected")
        return 1

    reports = LinkReports(lambda t: landed.append(t.key), lambda t, e: failed.append((t.key, e)), lambda s: None)
    worker = DiskWorker(cond, queue, read, reports, max_chunks=1)
    bad = Transfer(K(0, 0), chunks_of([Segment("bad", 0, 1)], torch.zeros(1, dtype=torch.uint8), 0))
    with cond:
        queue.push(bad)
        queue.push(transfer(K(0, 1)))
        cond.notify_all()
    deadline = time.time() + 5
    while len(landed) + len(failed) < 2 and time.time() < deadline:
        time.sleep(0.01)
    worker.stop(5)
    assert landed == [K(0, 1)] and failed[0][0] == K(0, 0) and "injected" in str(failed[0][1])


def test_demand_transfers_are_read_whole_together_and_speculation_in_rounds():
    cond, queue, batches, busy = threading.Condition(threading.RLock()), TransferQueue(8), [], []
    gate = threading.Event()

    def read(batch):
        gate.wait(5)
        batches.append(sorted(segments[0].offset for segments, _ in batch))
        return 1

    with cond:
        queue.push(transfer(K(0, 0), num_chunks=3, priority=0.5))
        queue.push(transfer(K(0, 1), num_chunks=3, at=1000, priority=0.9))
        queue.push(transfer(K(1, 0), num_chunks=2, at=5000, demand=True))
        queue.push(transfer(K(1, 1), num_chunks=2, at=7000, demand=True))
    landed = []
    reports = LinkReports(lambda t: landed.append(t.key), lambda t, e: None, busy.append)
    worker = DiskWorker(cond, queue, read, reports, max_chunks=4)
    gate.set()
    deadline = time.time() + 5
    while len(landed) < 4 and time.time() < deadline:
        time.sleep(0.01)
    worker.stop(5)
    assert batches == [[5000, 5100, 7000, 7100], [0, 1000, 1100, 1200], [100, 200]]
    assert landed == [K(1, 0), K(1, 1), K(0, 1), K(0, 0)] and len(busy) == 3
