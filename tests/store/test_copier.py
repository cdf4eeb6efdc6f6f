import threading
import time

import torch

from moestream.store.copier import CopyWorker, HostCopy
from moestream.store.streams import CpuLink
from moestream.store.transfer import TransferQueue
from moestream.topology import ExpertKey

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


def host_copy(key, fill, demand=False, priority=0.0):
    src = torch.full((4,), fill, dtype=torch.uint8)
    return HostCopy(key, [], priority=priority, demand=demand, src=src, dst=torch.zeros(4, dtype=torch.uint8))


def run(copies):
    """Queues copies, runs a worker until each is reported; returns (landed keys, failures, busy calls)."""
    cond, queue, gate = threading.Condition(threading.RLock()), TransferQueue(8), threading.Event()
    landed, failed, busy = [], [], []
    with cond:
        for copy in copies[:1]:
            queue.push(copy)
    link = GatedLink(gate)
    worker = CopyWorker(cond, queue, link, lambda c: landed.append(c.key),
                        lambda c, e: failed.append((c.key, str(e))), busy.append)
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
    assert landed == [K(0, 0), K(1, 0), K(0, 1), K(0, 2)] and not failed and len(busy) == 4
    assert all(torch.equal(c.dst, c.src) for c in copies)


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
