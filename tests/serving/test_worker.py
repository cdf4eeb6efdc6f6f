"""The engine worker's admission: waiting requests join while the batcher has room, an idle engine
waits at most max_wait_ms for company, cancelled ones are dropped (counted as aborted), requests that
wait too long fail, a full queue refuses with Overloaded, and a request's first event says whether
it got in."""

import dataclasses
import time

import pytest

from moestream.config import BatchingConfig
from moestream.errors import MoestreamError
from moestream.runtime.scheduling.scheduler import KvBudgetError
from moestream.serving.generation import Admitted, Request, TextDelta
from moestream.serving.sampling import SamplingParams
from moestream.serving.worker import EngineWorker, Overloaded, WorkerConfig


@pytest.fixture
def make_worker(engine):
    workers = []

    def make(**fields):
        workers.append(EngineWorker(engine, WorkerConfig(**fields)))
        return workers[-1]

    yield make
    for worker in workers:
        worker.close()


def _request(seen=None):
    return Request([1, 2, 3], SamplingParams(max_tokens=2), (seen if seen is not None else []).append)


def test_waiting_requests_join_while_there_is_room(make_worker):
    worker = make_worker(max_wait_ms=0, batching=BatchingConfig(max_batch_size=3))
    requests = [_request() for _ in range(5)]
    for request in requests:
        worker.submit(request)
    assert worker.admit() == requests[:3]
    assert worker.admit() == []  # full until a sequence leaves
    while worker.num_running == 3:
        worker.batcher.step()
    free = 3 - worker.num_running
    assert worker.admit() == requests[3:3 + free]


def test_an_idle_engine_waits_at_most_max_wait_for_company(make_worker):
    worker = make_worker(max_wait_ms=50)
    worker.submit(_request())
    started = time.perf_counter()
    assert len(worker.admit()) == 1
    assert 0.04 <= time.perf_counter() - started < 1.0


def test_cancelled_requests_are_dropped_and_counted(make_worker):
    worker = make_worker(max_wait_ms=0)
    kept, dropped = _request(), _request()
    worker.submit(kept)
    worker.submit(dropped)
    dropped.cancel()
    assert worker.admit() == [kept]
    assert 'moestream_requests_total{finish_reason="abort"} 1.0' in worker.metrics.render().decode()


def test_a_request_waiting_too_long_fails(make_worker):
    wait_ms = 60_000.0  # no step of a loaded machine between submit and admit comes near it
    worker = make_worker(max_wait_ms=0, max_queue_wait_ms=wait_ms, batching=BatchingConfig(max_batch_size=1))
    running, late = [], []
    worker.submit(_request(running))
    worker.submit(dataclasses.replace(_request(late), arrived=time.perf_counter() - wait_ms / 1e3))  # waited long
    assert len(worker.admit()) == 1  # the first takes the batch's one place
    assert worker.admit() == []  # the second has waited past max_queue_wait_ms: it fails
    assert len(late) == 1 and isinstance(late[0], Overloaded)


def test_a_full_queue_refuses_and_close_fails_the_waiting(make_worker):
    worker = make_worker(max_queue=2)
    seen = []
    worker.submit(_request(seen))
    worker.submit(_request(seen))
    with pytest.raises(Overloaded):
        worker.submit(_request())
    worker.close()
    assert len(seen) == 2 and all(isinstance(e, Overloaded) for e in seen)


def test_a_request_hears_first_whether_it_got_in(make_worker):
    """Admitted before any text; a request too big for the KV budget gets only its refusal, even
    from a worker that has run nothing yet."""
    admitted, refused = [], []
    worker = make_worker(max_wait_ms=0)
    worker.submit(_request(admitted))
    assert len(worker.admit()) == 1
    while worker.batcher.step():
        pass
    assert admitted[0] == Admitted() and all(isinstance(e, TextDelta) for e in admitted[1:]) and admitted[-1].finished
    per_token = worker.batcher.scheduler.admission.bytes_per_token  # a budget of 3 tokens: a request, not this one
    tight = make_worker(max_wait_ms=0, batching=BatchingConfig(kv_budget_bytes=3 * per_token))
    tight.submit(_request(refused))
    assert tight.admit() == []
    assert len(refused) == 1 and isinstance(refused[0], KvBudgetError)


@pytest.mark.parametrize("fields", [{"max_queue": 0}, {"max_wait_ms": -1}, {"max_queue_wait_ms": 0}])
def test_bad_worker_config_is_refused(fields):
    with pytest.raises(MoestreamError):
        WorkerConfig(**fields)


@pytest.mark.parametrize("fields", [{"max_batch_size": 0}, {"kv_budget_bytes": 0}, {"prefill_token_budget": 0},
                                    {"token_scheduler": "psychic"}, {"max_prefill_delay_ms": -1.0},
                                    {"max_prefill_delay_ms": float("nan")}])
def test_bad_batching_config_is_refused(fields):
    with pytest.raises(MoestreamError):
        BatchingConfig(**fields)


def test_draining_refuses_new_requests_and_ends_running_ones_after_the_grace(make_worker):
    worker = make_worker(max_wait_ms=0)
    running_seen, waiting_seen = [], []
    running = Request([1, 2, 3], SamplingParams(max_tokens=1000), running_seen.append)
    worker.submit(running)
    assert worker.admit() == [running]
    worker.submit(Request([1, 2, 3], SamplingParams(max_tokens=2), waiting_seen.append))
    worker.drain(grace_s=0.3)
    worker.start()
    with pytest.raises(Overloaded, match="shutting down"):
        worker.submit(_request())
    deadline = time.monotonic() + 30
    while worker.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not worker.alive  # the engine thread stopped by itself
    assert isinstance(waiting_seen[0], Overloaded) and "shutting down" in str(waiting_seen[0])
    last = running_seen[-1]
    assert isinstance(last, TextDelta) and last.finished and last.finish_reason == "abort"
    assert 1 < len(running_seen) < 1000  # it ran during the grace, and was ended before its max_tokens


def test_an_engine_that_fails_with_any_error_stops_the_thread_and_keeps_the_error(make_worker):
    worker = make_worker(max_wait_ms=0)
    stopped, seen = [], []

    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    worker.on_failure = lambda: stopped.append(True)
    worker.step_listeners.append(out_of_memory)  # runs on the engine thread after its first step
    worker.submit(Request([1, 2, 3], SamplingParams(max_tokens=1000), seen.append))
    worker.start()
    deadline = time.monotonic() + 30
    while worker.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not worker.alive and stopped == [True]
    assert isinstance(worker.failure, RuntimeError) and "out of memory" in str(worker.failure)
    with pytest.raises(Overloaded):
        worker.submit(_request())
    last = seen[-1]
    assert isinstance(last, TextDelta) and last.finished  # the running request was ended, not left waiting
