"""Runs a predictor off the critical path: events go to a worker thread, predict() answers at once.

`BackgroundPredictor` wraps any `Predictor`: begin_iteration / observe / end_sequence are queued for the
worker in order; predict(layer_now, horizon) queues a request and returns the latest completed one,
rebased to the caller's position (layers already passed are dropped). After flush(), predict() returns
exactly what the wrapped predictor would. synchronous=True runs every call inline (the simulator, tests,
`bench fidelity`). The queue is bounded (`max_pending`): no event is dropped, the caller waits, and every
wait gives up after `timeout_s` with a `BackgroundTimeout`. `offload_predictor(policy)` wraps the
predictor of a policy that sets `Policy.predicts_in_background`. Knows no policy by name.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from moestream.contracts import Policy, Prediction, Predictor
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent

if TYPE_CHECKING:
    from moestream.trace.schema import Trace

_STOP = object()
MAX_PENDING = 1024  # events and requests queued for the worker: about 20 tokens of a 26-layer model


class BackgroundTimeout(MoestreamError):
    """The predictor's worker did not catch up within the wait's timeout."""


def _signal(done: threading.Event) -> None:
    done.set()


@dataclass(frozen=True)
class _Request:
    iteration: int  # begin_iteration calls seen by the caller when it asked
    layer_now: int
    horizon_layers: int


@dataclass(frozen=True)
class _Result:
    request: _Request
    predictions: tuple[Prediction, ...]


class BackgroundPredictor(Predictor):
    """A predictor whose events and predictions run on a worker thread (see the module doc)."""

    def __init__(self, inner: Predictor, synchronous: bool = False, max_pending: int = MAX_PENDING,
                 timeout_s: float = 60.0):
        super().__init__(inner.topology)
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.inner = inner
        self.synchronous = synchronous
        self.timeout_s = timeout_s
        self.needs_hidden = inner.needs_hidden
        self.needs_embeddings = inner.needs_embeddings
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._iteration = 0
        self._requested: _Request | None = None
        self._latest: _Result | None = None

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._iteration += 1
        self._submit(self.inner.begin_iteration, ctx)

    def observe(self, event: RoutingEvent) -> None:
        self._submit(self.inner.observe, event)

    def end_sequence(self, seq_id: int) -> None:
        self._submit(self.inner.end_sequence, seq_id)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        if self.synchronous:
            return self.inner.predict(layer_now, horizon_layers)
        request = _Request(self._iteration, layer_now, horizon_layers)
        if request != self._requested:
            self._requested = request
            self._submit(self._compute, request)
        return self._rebased(self._latest, layer_now)

    def fit(self, trace: "Trace") -> None:
        self.flush()
        self.inner.fit(trace)

    def reset(self) -> None:
        self.flush()
        self.inner.reset()
        self._latest = self._requested = None

    def flush(self) -> None:
        if self._thread is not None:
            done = threading.Event()
            self._put((_signal, done))
            if not done.wait(self.timeout_s):
                raise BackgroundTimeout(f"the background predictor did not catch up within {self.timeout_s:g} s")
        self._raise_worker_error()

    def close(self) -> None:
        """Stop the worker after the queued work; the wrapper then runs inline (one that does not stop in time
        is kept, and the wrapper stays asynchronous)."""
        if self._thread is not None:
            self._put(_STOP)
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise BackgroundTimeout(f"the background predictor did not stop within {self.timeout_s:g} s")
            self._thread = None
        self.synchronous = True
        self._raise_worker_error()

    def _submit(self, call: Callable[[Any], Any], argument: Any) -> None:
        self._raise_worker_error()
        if self.synchronous:
            call(argument)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="moestream-predictor", daemon=True)
            self._thread.start()
        self._put((call, argument))

    def _put(self, job) -> None:
        try:
            self._jobs.put(job, timeout=self.timeout_s)
        except queue.Full:
            raise BackgroundTimeout(f"the background predictor fell {self._jobs.maxsize} jobs behind and did not "
                                    f"catch up within {self.timeout_s:g} s") from None

    def _compute(self, request: _Request) -> None:
        if request != self._requested:
            return  # a newer request superseded this one before the worker reached it
        predictions = self.inner.predict(request.layer_now, request.horizon_layers)
        self._latest = _Result(request, tuple(predictions))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            call, argument = job
            try:
                if self._error is None or call is _signal:
                    call(argument)
            except BaseException as error:  # re-raised in the caller's thread
                self._error = error

    def _rebased(self, result: _Result | None, layer_now: int) -> list[Prediction]:
        if result is None:
            return []
        elapsed = self._iteration - result.request.iteration
        kept = []
        for p in result.predictions:
            ahead = p.tokens_ahead - elapsed
            if ahead > 0 or (ahead == 0 and p.layer > layer_now):
                kept.append(p if ahead == p.tokens_ahead else p._replace(tokens_ahead=ahead))
        return kept

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the background predictor failed") from error


def offload_predictor(policy: Policy, synchronous: bool = False, timeout_s: float = 60.0) -> BackgroundPredictor | None:
    """Wrap the predictor of a policy that asks for it, else None; call before collecting its observers."""
    if not policy.predicts_in_background:
        return None
    if isinstance(policy.predictor, BackgroundPredictor):
        return policy.predictor
    policy.predictor = BackgroundPredictor(policy.predictor, synchronous=synchronous, timeout_s=timeout_s)
    return policy.predictor
