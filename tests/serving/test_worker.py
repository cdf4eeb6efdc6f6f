"""The engine worker's schedule: requests waiting together form batches of at most max_batch_size,
cancelled ones are dropped (counted as aborted), and a full queue refuses with Overloaded."""

import time

import pytest

from moestream.errors import MoestreamError
from moestream.serving.sampling import SamplingParams
from moestream.serving.worker import EngineWorker, Overloaded, Request, WorkerConfig


def _request(seen=None):
    return Request([1, 2, 3], SamplingParams(), (seen if seen is not None else []).append)


def test_waiting_requests_form_batches_of_at_most_the_batch_size():
    worker = EngineWorker(None, WorkerConfig(max_batch_size=3, max_wait_ms=0))
    requests = [_request() for _ in range(5)]
    for request in requests:
        worker.submit(request)
    assert worker.schedule() == requests[:3]
    assert worker.schedule() == requests[3:]
    assert worker.schedule() == []


def test_the_first_request_waits_at_most_max_wait_for_company():
    worker = EngineWorker(None, WorkerConfig(max_batch_size=4, max_wait_ms=50))
    worker.submit(_request())
    started = time.perf_counter()
    assert len(worker.schedule()) == 1
    assert 0.04 <= time.perf_counter() - started < 1.0


def test_cancelled_requests_are_dropped_and_counted():
    worker = EngineWorker(None, WorkerConfig(max_wait_ms=0))
    kept, dropped = _request(), _request()
    worker.submit(kept)
    worker.submit(dropped)
    dropped.cancel()
    assert worker.schedule() == [kept]
    assert 'moestream_requests_total{finish_reason="abort"} 1.0' in worker.metrics.render().decode()


def test_a_full_queue_refuses_and_close_fails_the_waiting():
    worker = EngineWorker(None, WorkerConfig(max_queue=2))
    seen = []
    worker.submit(_request(seen))
    worker.submit(_request(seen))
    with pytest.raises(Overloaded):
        worker.submit(_request())
    worker.close()
    assert len(seen) == 2 and all(isinstance(e, Overloaded) for e in seen)


@pytest.mark.parametrize("fields", [{"max_batch_size": 0}, {"max_queue": 0}, {"max_wait_ms": -1}])
def test_bad_worker_config_is_refused(fields):
    with pytest.raises(MoestreamError):
        WorkerConfig(**fields)
