import threading
import time

import pytest
import torch

from moestream.checkpoint.layout import Segment
from moestream.store.transfer import (MAX_CHUNKS_IN_FLIGHT, DiskWorker, Transfer, TransferError, TransferQueue,
                                      chunks_of)
from moestream.topology import ExpertKey
from tests.store.test_tiered import wait_for

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


class HeldReads:
    """A DiskWorker's read callback: each read records the offsets of its chunks, then waits until the test
    lets it finish (`finish`), failing if told to."""

    def __init__(self):
        self.cond = threading.Condition()
        self.started: list[list[int]] = []  # each read's chunk offsets, in the order the reads began
        self._finish: dict[int, bool] = {}  # read number -> whether it fails
        self._finish_all = False

    def __call__(self, batch):
        with self.cond:
            number = len(self.started)
            self.started.append([segments[0].offset for segments, _ in batch])
            self.cond.notify_all()
            finished = self.cond.wait_for(lambda: self._finish_all or number in self._finish, 10)
            assert finished, "the test never finished a read"
            if self._finish.get(number, False):
                raise OSError("injected")
        return 1

    def finish(self, *numbers, fail=False):
        with self.cond:
            self._finish.update((n, fail) for n in numbers)
            self.cond.notify_all()

    def finish_all(self):
        with self.cond:
            self._finish_all = True
            self.cond.notify_all()

    def wait_for(self, test):
        with self.cond:
            assert self.cond.wait_for(lambda: test(self.started), 10), f"reads so far: {self.started}"


class Reports:
    """The worker's callbacks, recorded; `settled` counts its reports of busy time (one per settling)."""

    def __init__(self):
        self.landed, self.failed, self.settled = [], [], 0

    def worker(self, cond, queue, read):
        """A DiskWorker with the shipped max_chunks."""
        return DiskWorker(cond, queue, read, lambda t: self.landed.append(t.key),
                          lambda t, e: self.failed.append((t.key, str(e))), self.busy)

    def busy(self, *report):  # seconds busy, stretches begun
        self.settled += 1


def test_speculative_chunks_are_read_each_on_its_own_and_max_chunks_in_flight():
    cond, queue, reads, reports = threading.Condition(threading.RLock()), TransferQueue(8), HeldReads(), Reports()
    worker = reports.worker(cond, queue, reads)
    with cond:
        queue.push(transfer(K(0, 0), num_chunks=12, priority=1.0))
        cond.notify_all()
    reads.wait_for(lambda started: len(started) == MAX_CHUNKS_IN_FLIGHT)
    with cond:
        assert queue.cancel(K(0, 0)) is None  # its chunks are in flight: the worker holds it
    reads.finish_all()
    wait_for(lambda: reports.landed)
    worker.stop(5)
    assert sorted(reads.started) == [[100 * i] for i in range(12)] and reports.landed == [K(0, 0)]


def test_a_demand_starts_as_soon_as_one_speculative_chunk_in_flight_completes():
    """With the shipped max_chunks: a demand queued behind speculative reads in flight starts once one of
    them completes, and no speculative chunk starts after it was queued and before it."""
    cond, queue, reads, reports = threading.Condition(threading.RLock()), TransferQueue(8), HeldReads(), Reports()
    worker = reports.worker(cond, queue, reads)
    with cond:
        queue.push(transfer(K(0, 0), num_chunks=12, priority=1.0))
        cond.notify_all()
    reads.wait_for(lambda started: sum(map(len, started)) == MAX_CHUNKS_IN_FLIGHT)
    with cond:
        queue.push(transfer(K(1, 0), num_chunks=2, at=7, demand=True))
        cond.notify_all()
        queued_at = len(reads.started)
    reads.finish(0)  # one speculative read completes
    reads.wait_for(lambda started: any(7 in offsets for offsets in started))
    demand = next(i for i, offsets in enumerate(reads.started) if 7 in offsets)
    assert demand == queued_at and reads.started[demand] == [7, 107]  # whole, right after the one read
    assert sum(map(len, reads.started[:1])) == 1  # which was one chunk
    reads.finish_all()
    wait_for(lambda: len(reports.landed) == 2)
    worker.stop(5)
    assert reports.landed == [K(1, 0), K(0, 0)] and not reports.failed
    assert sorted(o for offsets in reads.started for o in offsets) == sorted([7, 107] + [100 * i for i in range(12)])


def test_a_failed_read_is_reported_and_the_worker_goes_on():
    cond, queue, failed, landed = threading.Condition(threading.RLock()), TransferQueue(8), [], []

    def read(batch):
        if batch[0][0][0].file == "bad":
            raise OSError("injected")
        return 1

    worker = DiskWorker(cond, queue, read, lambda t: landed.append(t.key), lambda t, e: failed.append((t.key, e)),
                        lambda *report: None)
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


def test_a_failed_chunk_is_reported_once_its_other_chunks_in_flight_have_completed():
    """The store frees a failed transfer's slot: no read may still be writing it then."""
    cond, queue, reads, reports = threading.Condition(threading.RLock()), TransferQueue(8), HeldReads(), Reports()
    worker = reports.worker(cond, queue, reads)
    with cond:
        queue.push(transfer(K(0, 0), num_chunks=3, priority=1.0))
        cond.notify_all()
    reads.wait_for(lambda started: len(started) == 3)
    reads.finish(0, fail=True)
    wait_for(lambda: reports.settled == 1)
    with cond:
        assert reports.failed == [] and reports.landed == []  # two of its chunks are still being read
    reads.finish(1, 2)
    wait_for(lambda: reports.failed)
    worker.stop(5)
    assert reports.failed == [(K(0, 0), "injected")] and len(reads.started) == 3


def test_demand_transfers_are_read_whole_together_and_alone():
    cond, queue, reads, reports = threading.Condition(threading.RLock()), TransferQueue(8), HeldReads(), Reports()
    with cond:
        queue.push(transfer(K(0, 0), num_chunks=3, priority=0.5))
        queue.push(transfer(K(0, 1), num_chunks=3, at=1000, priority=0.9))
        queue.push(transfer(K(1, 0), num_chunks=2, at=5000, demand=True))
        queue.push(transfer(K(1, 1), num_chunks=2, at=7000, demand=True))
    worker = reports.worker(cond, queue, reads)
    reads.wait_for(lambda started: started)
    with cond:  # the worker took its moves before the first read began
        assert reads.started == [[5000, 5100, 7000, 7100]] and len(queue) == 2  # no speculation beside it
    reads.finish_all()
    wait_for(lambda: len(reports.landed) == 4)
    worker.stop(5)
    assert sorted(reads.started[1:]) == [[0], [100], [200], [1000], [1100], [1200]]
    assert reports.landed[:2] == [K(1, 0), K(1, 1)] and set(reports.landed[2:]) == {K(0, 0), K(0, 1)}


def test_a_link_needs_a_place_for_a_move():
    with pytest.raises(ValueError, match="max_chunks >= 1"):
        DiskWorker(threading.Condition(), TransferQueue(1), lambda batch: 0, *[lambda *args: None] * 3, max_chunks=0)
