"""The engine thread, the one that runs the engine, fed by a bounded queue of requests (docs/design.md, Scheduling).

Its loop admits waiting requests while the batcher has room (idle, the first waits up to max_wait_ms for company), fails
those that waited over max_queue_wait_ms, and runs one engine step. A request's first event is `Admitted` or the
exception that refused it; each step's text follows. An engine that fails stops the thread: its requests end, new ones
are refused, `failure` holds the error and `on_failure` is called. No HTTP.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from moestream.config import WorkerConfig
from moestream.errors import MoestreamError
from moestream.runtime.scheduling.scheduler import KvBudgetError
from moestream.serving import logs
from moestream.serving.batching import Batcher
from moestream.serving.generation import Admitted, Request, TextDelta
from moestream.serving.metrics import ServerMetrics

POLL_S = 0.05


class Overloaded(MoestreamError):
    """The server cannot take the request: queue full, waited too long for room, or shutting down."""


class EngineWorker:
    def __init__(self, engine, config: WorkerConfig | None = None):
        self.engine = engine
        self.config = config or WorkerConfig()
        self._queue: queue.Queue[Request] = queue.Queue(self.config.max_queue)
        self._head: Request | None = None  # taken from the queue, waiting for room
        self.batcher = Batcher(engine, self.config.batching, self.update)
        self.metrics = ServerMetrics(self._queue.qsize, lambda: len(self.batcher.requests),
                                     lambda: self.batcher.scheduler.reserved_bytes)
        self.step_listeners: list[Callable[[], None]] = []  # called on the engine thread after each step
        self._stop = threading.Event()
        self._periodic, self._num_finished = logs.Periodic(host_compute=engine.config.host_compute != "off"), 0
        self._draining, self._drain_deadline = threading.Event(), 0.0
        self._thread = threading.Thread(target=self._run, name="moestream-engine", daemon=True)
        self.failure: Exception | None = None
        self.on_failure: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        if self._draining.is_set():
            raise Overloaded("the server is shutting down")
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self.metrics.rejected.inc()
            raise Overloaded(f"the request queue is full ({self.config.max_queue} waiting)") from None

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.batcher.close()
        self._fail_waiting()
        logs.stopped(self._num_finished)

    def drain(self, grace_s: float) -> None:
        """Stops admitting; running requests may finish within grace_s, then end ('abort'). Any thread."""
        self._drain_deadline = time.perf_counter() + grace_s
        self._draining.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.batcher.requests)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as error:  # a MoestreamError (a lost rank) or any other: the server must not go on
            self.failure = error
            self._draining.set()  # new requests are refused
            self.batcher.close()
            self._fail_waiting()
            if self.on_failure is not None:
                self.on_failure()

    def _loop(self) -> None:
        self.engine.store.reset_stats()  # the metrics count from here
        self.engine.experts.take_host_computed()  # and the experts computed on the host
        while not self._stop.is_set():
            if self._draining.is_set():
                if self._drained():
                    return
            else:
                self.admit()
            if self.batcher.requests:
                self.metrics.batch_size.observe(len(self.batcher.requests))
                self.batcher.step()
                on_host = self.engine.experts.take_host_computed()  # device-tier misses computed on the host
                self.metrics.observe_store(self.engine.store.stats(), on_host)
                self._periodic.host_computed(on_host)
                for listener in self.step_listeners:
                    listener()
            else:
                self.engine.steps.idle()
            self._periodic.maybe_log(len(self.batcher.requests), self._queue.qsize(), self.engine.store.stats)

    def _drained(self) -> bool:
        """While draining: fails waiting requests; True once nothing runs or the grace period is over."""
        self._fail_waiting()
        if self.batcher.requests and time.perf_counter() < self._drain_deadline:
            return False
        self.batcher.close()
        return True

    def _fail_waiting(self) -> None:
        while (request := self._peek(0.0)) is not None:
            self._head = None
            request.emit(Overloaded("the server is shutting down"))

    def admit(self) -> list[Request]:
        """Takes waiting requests in while there is room; idle, it waits up to POLL_S for a first request,
        then up to max_wait_ms for others."""
        self._drop_expired()
        idle = not self.batcher.requests
        admitted = self._admit_ready(block_s=POLL_S if idle else 0.0)
        if idle and admitted:
            deadline = time.perf_counter() + self.config.max_wait_ms / 1e3
            while (left := deadline - time.perf_counter()) > 0 and self._room() and self._head is None:
                admitted += self._admit_ready(block_s=left, limit=1)
        return admitted

    def _admit_ready(self, block_s: float, limit: int | None = None) -> list[Request]:
        admitted = []
        while self._room() and (limit is None or len(admitted) < limit):
            request = self._take(block_s if not admitted else 0.0)
            if request is None:
                break
            if self._admissible(request):
                admitted.append(request)
        return admitted

    def _drop_expired(self) -> None:
        while (head := self._peek(0.0)) is not None and (head.cancelled or self._expired(head)):
            self._head = None
            self._admissible(head)  # fails it

    def _room(self) -> bool:
        return len(self.batcher.requests) < self.batcher.config.num_seqs

    def _peek(self, block_s: float) -> Request | None:
        if self._head is None:
            try:
                self._head = self._queue.get(timeout=block_s) if block_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                pass
        return self._head

    def _take(self, block_s: float) -> Request | None:
        """The head request if the batcher can take it now (else it stays the head), or None."""
        head = self._peek(block_s)
        if head is None or not (head.cancelled or self.batcher.can_admit(head) or not self.batcher.fits(head)
                                or self._expired(head)):
            return None
        self._head = None
        return head

    def _expired(self, request: Request) -> bool:
        return (time.perf_counter() - request.arrived) * 1e3 > self.config.max_queue_wait_ms

    def _admissible(self, request: Request) -> bool:
        """Admits the request, or fails it (cancelled, waited too long, too big)."""
        if request.cancelled:
            self.metrics.requests.labels("abort").inc()
            return False
        if self._expired(request):
            self.metrics.rejected.inc()
            request.emit(Overloaded(f"the request waited over {self.config.max_queue_wait_ms:g} ms for room"))
            return False
        try:
            self.batcher.admit(request)
        except KvBudgetError as error:
            request.emit(error)
            return False
        request.emit(Admitted())
        return True

    def update(self, request: Request, delta: TextDelta, new_token: bool) -> None:
        """Records latencies and hands the request its text (new_token: False when it ends without one)."""
        now = time.perf_counter()
        if new_token:
            request.num_tokens += 1
            self._periodic.tokens(1)
            if request.first_token is None:
                request.first_token = now
                self.metrics.ttft.observe(now - request.arrived)
        if delta.finished:
            self._num_finished += 1
            logs.finished(self._num_finished, request, delta.finish_reason)
            self.metrics.requests.labels(delta.finish_reason).inc()
            self.metrics.tokens.inc(request.num_tokens)
            if request.num_tokens > 1:
                self.metrics.tpot.observe((now - request.first_token) / (request.num_tokens - 1))
        request.emit(delta)

