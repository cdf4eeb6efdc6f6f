"""The host -> device link: its copy function (`copy_round`) on a worker thread, as the asynchronous store
runs it."""

import threading
import time

import torch

from moestream.checkpoint.layout import Segment
from moestream.store.copies import copy_round
from moestream.store.streams import CpuLink
from moestream.store.transfer import H2D, LinkReports, Transfer, TransferQueue, pieces
from moestream.topology import ExpertKey
from tests.store.test_transfer import start_link

K = ExpertKey


class GatedLink(CpuLink):
    """The CPU link, each copy once the gate opens; fails copies from a source filled with 255."""

    def __init__(self, gate):
        super().__init__(torch.device("cpu"))
        self.gate, self.entered = gate, threading.Event()

    def copy(self, dst, src, after=None):
        self.entered.set()
        self.gate.wait(5)
        if bool((src == 255).all()):
            raise RuntimeError("injected")
        return super().copy(dst, src, after)


def host_copy(key, fill, demand=False, priority=0.0, nbytes=4, chunk_bytes=0):
    """A copy of nbytes (one weight matrix), in chunks of chunk_bytes (0: one chunk); its src is
    filled with `fill` and its dst with zeros."""
    src, dst = torch.full((nbytes,), fill, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    parts = pieces([Segment("weights.safetensors", 0, nbytes)], chunk_bytes)
    return Transfer(key, dst, parts, src, priority=priority, demand=demand, link=H2D)


def run(copies, max_chunks=8):
    """Queues copies, runs a worker until each is reported; returns (landed keys, failures, rounds)."""
    cond, queue, gate = threading.Condition(threading.RLock()), TransferQueue(8), threading.Event()
    landed, failed = [], []
    with cond:
        for copy in copies[:1]:
            queue.push(copy)
    link = GatedLink(gate)
    reports = LinkReports(landed=lambda c: landed.append(c.key), failed=lambda c, e: failed.append((c.key, str(e))))
    executor, tracer = start_link(cond, queue, link, reports, max_chunks, lane=H2D, move=copy_round)
    link.entered.wait(5)  # the worker holds the first copy at the gate
    with cond:
        for copy in copies[1:]:
            queue.push(copy)
    gate.set()
    deadline = time.time() + 5
    while len(landed) + len(failed) < len(copies) and time.time() < deadline:
        time.sleep(0.005)
    executor.stop()
    return landed, failed, tracer.totals()[H2D].spans


def test_a_demand_copy_goes_ahead_of_queued_speculation_and_bytes_arrive():
    copies = [host_copy(K(0, 0), 1, priority=0.1), host_copy(K(0, 1), 2, priority=0.9),
              host_copy(K(0, 2), 3, priority=0.5), host_copy(K(1, 0), 4, demand=True)]
    landed, failed, rounds = run(copies)
    assert landed == [K(0, 0), K(1, 0), K(0, 1), K(0, 2)] and not failed
    assert rounds == 3  # rounds: the first copy; the demand alone; both speculative copies together
    assert all(torch.equal(c.dst, c.src) for c in copies)


def test_a_demand_waits_one_round_of_chunks_behind_a_long_speculative_copy():
    long = host_copy(K(0, 0), 9, priority=0.9, nbytes=64, chunk_bytes=4)  # 16 chunks
    copies = [long, host_copy(K(1, 0), 4, demand=True, nbytes=64, chunk_bytes=4)]
    landed, failed, rounds = run(copies, max_chunks=2)
    assert landed == [K(1, 0), K(0, 0)] and not failed  # the demand went in after the first round of 2
    assert rounds == 1 + 1 + 7  # the first round, the demand whole, then the 14 chunks left by 2
    assert all(torch.equal(c.dst, c.src) for c in copies)


def test_a_failed_copy_is_reported_and_the_worker_goes_on():
    copies = [host_copy(K(0, 0), 255), host_copy(K(0, 1), 7)]
    landed, failed, _ = run(copies)
    assert landed == [K(0, 1)] and failed == [(K(0, 0), "injected")]
    assert not copies[0].dst.any()


def test_stop_ends_the_idle_worker():
    threads = threading.active_count()
    cond = threading.Condition(threading.RLock())
    executor, _ = start_link(cond, TransferQueue(1), CpuLink(torch.device("cpu")), LinkReports(*[lambda *args: None] * 2),
                             8, lane=H2D, move=copy_round)
    assert threading.active_count() == threads + 1
    executor.stop()
    assert threading.active_count() == threads
