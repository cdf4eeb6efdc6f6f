import threading
import time

import torch

from moestream.checkpoint.layout import Segment
from moestream.store.copier import COPIES_IN_FLIGHT, CopyWorker, HostCopy, copy_chunks
from moestream.store.streams import CpuLink
from moestream.store.transfer import TransferQueue
from moestream.topology import ExpertKey
from tests.store.links import LateLink
from tests.store.test_tiered import wait_for

K = ExpertKey


class GatedLink(CpuLink):
    """The CPU link, each copy once the gate opens; fails copies from a source filled with 255."""

    def __init__(self, gate):
        super().__init__(torch.device("cpu"))
        self.gate, self.entered = gate, threading.Event()

    def copy(self, dst, src):
        self.entered.set()
        self.gate.wait(5)
        if bool((src == 255).all()):
            raise RuntimeError("injected")
        return super().copy(dst, src)


def host_copy(key, fill, demand=False, priority=0.0, nbytes=4, chunk_bytes=0):
    """A copy of nbytes (one weight matrix), in chunks of chunk_bytes (0: one chunk); its src is
    filled with `fill` and its dst with zeros."""
    src, dst = torch.full((nbytes,), fill, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    chunks = copy_chunks([Segment("weights.safetensors", 0, nbytes)], src, dst, chunk_bytes)
    copy = HostCopy(key, chunks, priority=priority, demand=demand)
    copy.src, copy.dst = src, dst
    return copy


def run(copies):
    """Queues copies, runs a worker until each is reported; returns (landed keys, failures, busy reports)."""
    cond, queue, gate = threading.Condition(threading.RLock()), TransferQueue(8), threading.Event()
    landed, failed, busy = [], [], []
    with cond:
        for copy in copies[:1]:
            queue.push(copy)
    link = GatedLink(gate)
    worker = CopyWorker(cond, queue, link, lambda c: landed.append(c.key),
                        lambda c, e: failed.append((c.key, str(e))), lambda *report: busy.append(report))
    link.entered.wait(5)  # the worker holds the first copy at the gate
    with cond:
        for copy in copies[1:]:
            queue.push(copy)
    gate.set()
    deadline = time.time() + 5
    while len(landed) + len(failed) < len(copies) and time.time() < deadline:
        time.sleep(0.005)
    worker.stop(5)
    return landed, failed, busy


def test_a_demand_copy_goes_ahead_of_queued_speculation_and_bytes_arrive():
    copies = [host_copy(K(0, 0), 1, priority=0.1), host_copy(K(0, 1), 2, priority=0.9),
              host_copy(K(0, 2), 3, priority=0.5), host_copy(K(1, 0), 4, demand=True)]
    landed, failed, busy = run(copies)
    assert landed == [K(0, 0), K(1, 0), K(0, 1), K(0, 2)] and not failed
    assert sum(stretches for _, stretches in busy) >= 1 and all(seconds >= 0 for seconds, _ in busy)
    assert all(torch.equal(c.dst, c.src) for c in copies)


def start_worker(link, copies):
    """A worker over the link (its shipped moves in flight) with the copies queued; returns (cond, queue,
    worker, landed keys)."""
    cond, queue, landed = threading.Condition(threading.RLock()), TransferQueue(8), []
    with cond:
        for copy in copies:
            queue.push(copy)
    worker = CopyWorker(cond, queue, link, lambda c: landed.append(c.key), lambda c, e: None, lambda *report: None)
    return cond, queue, worker, landed


def test_a_demand_copy_runs_behind_at_most_one_speculative_chunk_on_an_in_order_link():
    link = LateLink(credits=0)  # its copies complete later, in order, as the test allows
    long = host_copy(K(0, 0), 9, priority=0.9, nbytes=64, chunk_bytes=4)  # 16 chunks
    cond, queue, worker, landed = start_worker(link, [long])
    wait_for(lambda: len(link.issued) >= COPIES_IN_FLIGHT)  # the worker waits for the first one to run
    demand = host_copy(K(1, 0), 4, demand=True, nbytes=8, chunk_bytes=4)
    with cond:
        queue.push(demand)
        cond.notify_all()
        queued_at = len(link.issued)
    link.allow(1)  # the first speculative chunk completes
    wait_for(lambda: demand.dst.data_ptr() in link.issued)
    assert link.issued[queued_at:] == [demand.dst.data_ptr(), demand.dst.data_ptr() + 4]  # next, whole
    link.allow(100)
    wait_for(lambda: len(landed) == 2)
    worker.stop(5)
    assert landed == [K(1, 0), K(0, 0)] and all(torch.equal(c.dst, c.src) for c in (long, demand))
    assert link.ran.index(demand.dst.data_ptr()) <= 2  # behind the chunk copying and at most one more


def test_a_copy_lands_once_each_of_its_chunks_has_run_and_is_held_while_any_is_in_flight():
    link = LateLink(credits=0)
    copy = host_copy(K(0, 0), 5, priority=0.9, nbytes=12, chunk_bytes=4)  # 3 chunks
    cond, queue, worker, landed = start_worker(link, [copy])
    wait_for(lambda: len(link.issued) == COPIES_IN_FLIGHT)
    link.allow(2)
    wait_for(lambda: len(link.issued) == 3)
    with cond:
        assert landed == [] and queue.cancel(K(0, 0)) is None  # its last chunk is in flight: held, not queued
    link.allow(1)
    wait_for(lambda: landed)
    worker.stop(5)
    assert torch.equal(copy.dst, copy.src) and link.ran == link.issued


def test_a_failed_copy_is_reported_and_the_worker_goes_on():
    copies = [host_copy(K(0, 0), 255), host_copy(K(0, 1), 7)]
    landed, failed, _ = run(copies)
    assert landed == [K(0, 1)] and failed == [(K(0, 0), "injected")]
    assert not copies[0].dst.any()


def test_stop_ends_the_idle_worker():
    threads = threading.active_count()
    cond = threading.Condition(threading.RLock())
    worker = CopyWorker(cond, TransferQueue(1), CpuLink(torch.device("cpu")), *[lambda *args: None] * 3)
    assert threading.active_count() == threads + 1
    worker.stop(5)
    assert threading.active_count() == threads
