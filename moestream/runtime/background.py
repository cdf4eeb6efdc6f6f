"""Runs a predictor off the critical path: events go to a worker thread, predict() answers at once.

`BackgroundPredictor` wraps any `Predictor`. begin_iteration / observe / end_sequence are queued for
the worker, in order. predict(layer_now, horizon) queues a request for that prediction and returns
the latest one the worker has completed, rebased to the caller's position: a result computed at an
earlier layer or iteration loses the layers the caller has already passed. flush() waits until the
worker has caught up; after it, predict() at the same position returns exactly what the wrapped
predictor returns on the synchronous path. With synchronous=True (the simulator, tests) every call
runs inline.

`offload_predictor(policy)` is the engine's hook: it wraps the predictor of a policy whose class sets
`Policy.predicts_in_background`, and leaves other policies alone. This module knows no policy by
name, and nothing of what the wrapped predictor computes.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from moestream.events import IterationContext, RoutingEvent
from moestream.policies.contracts import Policy, Prediction, Predictor

if TYPE_CHECKING:
    from moestream.trace.schema import Trace

_STOP = object()


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

    def __init__(self, inner: Predictor, synchronous: bool = False):
        super().__init__(inner.topology)
        self.inner = inner
        self.synchronous = synchronous
        self.needs_hidden = inner.needs_hidden
        self.needs_embeddings = inner.needs_embeddings
        self._jobs: queue.Queue = queue.Queue()
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
        """Wait until the worker has handled every queued event and request."""
        if self._thread is not None:
            self._jobs.join()
        self._raise_worker_error()

    def close(self) -> None:
        """Stop the worker thread after the queued work; the wrapper then runs inline."""
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join()
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
        self._jobs.put((call, argument))

    def _compute(self, request: _Request) -> None:
        if request != self._requested:
            return  # a newer request superseded this one before the worker reached it
        predictions = self.inner.predict(request.layer_now, request.horizon_layers)
        self._latest = _Result(request, tuple(predictions))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:
                    call, argument = job
                    call(argument)
            except BaseException as error:  # re-raised in the caller's thread
                self._error = error
            finally:
                self._jobs.task_done()

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


def offload_predictor(policy: Policy, synchronous: bool = False) -> BackgroundPredictor | None:
    """Wrap the predictor of a policy that asks for it (Policy.predicts_in_background); else None.

    Call before the policy's observers are collected: Policy.observers() then lists the wrapper.
    """
    if not policy.predicts_in_background:
        return None
    if isinstance(policy.predictor, BackgroundPredictor):
        return policy.predictor
    policy.predictor = BackgroundPredictor(policy.predictor, synchronous=synchronous)
    return policy.predictor
