"""The engine thread: the one thread that runs the engine, fed by a bounded queue of requests.

The loop is schedule -> run -> update over plain records: `schedule` takes the requests that arrived
together (up to max_batch_size, waiting at most max_wait_ms after the first), `run` generates them
as one batch, and each step's text goes back to its request through the request's `emit` callable
(called on the engine thread). A cancelled request leaves its batch after the current step. The
worker knows no HTTP; a full queue raises `Overloaded`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from moestream.errors import MoestreamError
from moestream.serving.generation import TextDelta, run_batch
from moestream.serving.metrics import ServerMetrics
from moestream.serving.sampling import BatchSampler, SamplingParams

log = logging.getLogger(__name__)
POLL_S = 0.05


class Overloaded(MoestreamError):
    """The request queue is full."""


@dataclass(frozen=True)
class WorkerConfig:
    max_batch_size: int = 16
    max_wait_ms: float = 20.0  # how long the first request of a batch waits for others
    max_queue: int = 64  # requests waiting beyond this many are refused

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_queue < 1 or not self.max_wait_ms >= 0:
            raise MoestreamError("max_batch_size and max_queue must be >= 1 and max_wait_ms >= 0")


@dataclass
class Request:
    """One sequence to generate. emit gets TextDelta records, or an exception if the batch failed."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[TextDelta | Exception], None]
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    num_tokens: int = 0
    _sampler: tuple[BatchSampler, int] | None = None
    _cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stops the request: dropped if still queued, ended after the current step if running."""
        with self._lock:
            self._cancelled = True
            if self._sampler is not None:
                self._sampler[0].cancel(self._sampler[1])

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def attach(self, sampler: BatchSampler, row: int) -> None:
        with self._lock:
            self._sampler = sampler, row
            if self._cancelled:
                sampler.cancel(row)


class EngineWorker:
    def __init__(self, engine, config: WorkerConfig | None = None):
        self.engine = engine
        self.config = config or WorkerConfig()
        self._queue: queue.Queue[Request] = queue.Queue(self.config.max_queue)
        self.metrics = ServerMetrics(self._queue.qsize)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self.metrics.rejected.inc()
            raise Overloaded(f"the request queue is full ({self.config.max_queue} waiting)") from None

    def close(self) -> None:
        """Stops the thread after its current batch; queued requests are failed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait().emit(Overloaded("the server is shutting down"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self.schedule()
            if batch:
                self.run(batch)

    def schedule(self) -> list[Request]:
        """The next batch: the first request waiting, and those arriving within max_wait_ms of it."""
        try:
            first = self._queue.get(timeout=POLL_S)
        except queue.Empty:
            return []
        batch, deadline = [first], time.perf_counter() + self.config.max_wait_ms / 1e3
        while len(batch) < self.config.max_batch_size:
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.perf_counter())))
            except queue.Empty:
                break
        for request in batch:
            if request.cancelled:
                self.metrics.requests.labels("abort").inc()
        return [r for r in batch if not r.cancelled]

    def run(self, batch: list[Request]) -> None:
        if not batch:
            return
        self.metrics.batch_size.observe(len(batch))
        try:
            run_batch(self.engine, [r.prompt_ids for r in batch], [r.params for r in batch],
                      on_delta=lambda delta: self.update(batch[delta.row], delta),
                      on_sampler=lambda sampler: [r.attach(sampler, row) for row, r in enumerate(batch)])
        except Exception as error:  # the batch's clients get the error; the server stays up
            log.exception("engine batch failed")
            for request in batch:
                request.emit(error)
        self.metrics.observe_store(self.engine.store.stats())

    def update(self, request: Request, delta: TextDelta) -> None:
        """Records the request's latencies and hands it its new text."""
        now = time.perf_counter()
        request.num_tokens += 1
        if request.first_token is None:
            request.first_token = now
            self.metrics.ttft.observe(now - request.arrived)
        if delta.finished:
            self.metrics.requests.labels(delta.finish_reason).inc()
            self.metrics.tokens.inc(request.num_tokens)
            if request.num_tokens > 1:
                self.metrics.tpot.observe((now - request.first_token) / (request.num_tokens - 1))
        request.emit(delta)
