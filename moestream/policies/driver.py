"""The one place that calls a policy, in the contract's order, and times what the policy does.

Every consumer goes through a `PolicyDriver`: the simulator, predict-eval, the benchmark and the real
engine (whose publisher fans its events out through it, and whose prefetcher asks it per layer).
The order, for each iteration (see `moestream.policies.contracts`):

    begin_iteration(ctx)             every observer: the policy's, then the tiers' evictions, then extras
    predict(-1)                      the plan before the first layer
    for each MoE layer l:
        observe(event_l)             every observer, in the same order
        (the mechanism serves layer l's experts)
        predict(l) -> plan(view)     predictions for the layers ahead, and the planner's requests
    end_sequence(seq_id)             for each sequence that finished

`run_iteration` walks a replayed `Iteration` in that order and calls a `LayerMechanism` at the two
points where the mechanism acts; the engine, which is driven by the model's forward pass instead,
calls the same steps one by one. The driver times every call it makes into the policy
(`decision_seconds`), so every policy's cost per layer decision is measured the same way;
`TimedEviction` does the same for the eviction hooks a cache calls.
This module knows the contract, not any policy, cache, link or clock of the mechanism.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Protocol, Sequence

from moestream.events import IterationContext, RoutingEvent
from moestream.policies.contracts import (
    CacheView,
    EvictionPolicy,
    Observer,
    Policy,
    Prediction,
    TransferRequest,
)
from moestream.topology import ExpertKey
from moestream.trace.replay import Iteration


class LayerMechanism(Protocol):
    """What a replay does at the two points of a layer where the mechanism acts."""

    def routed(self, event: RoutingEvent, num_tokens: int) -> None:
        """Every observer has seen the layer's routing: serve its experts (hits, demand loads)."""

    def predicted(self, layer_now: int, predictions: list[Prediction]) -> None:
        """The predictions after layer_now (-1: before the first layer): plan, prefetch, compute."""


class PolicyDriver:
    def __init__(self, policy: Policy, evictions: Sequence[EvictionPolicy] = (),
                 observers: Sequence[Observer] = (), horizon_layers: int = 2):
        self.policy = policy
        self.horizon_layers = horizon_layers
        self.observers: list[Observer] = [*policy.observers(), *evictions, *observers]
        self.decision_seconds = 0.0  # wall time spent in the policy's calls made through this driver

    def add_observer(self, observer: Observer) -> None:
        self.observers.append(observer)

    def begin_iteration(self, ctx: IterationContext) -> None:
        start = time.perf_counter()
        for observer in self.observers:
            observer.begin_iteration(ctx)
        self.decision_seconds += time.perf_counter() - start

    def observe(self, event: RoutingEvent) -> None:
        start = time.perf_counter()
        for observer in self.observers:
            observer.observe(event)
        self.decision_seconds += time.perf_counter() - start

    def end_sequence(self, seq_id: int) -> None:
        start = time.perf_counter()
        for observer in self.observers:
            observer.end_sequence(seq_id)
        self.decision_seconds += time.perf_counter() - start

    def predict(self, layer_now: int) -> list[Prediction]:
        """The predictor's predictions for the horizon after layer_now (none with horizon 0)."""
        if not self.horizon_layers:
            return []
        start = time.perf_counter()
        predictions = self.policy.predictor.predict(layer_now, self.horizon_layers)
        self.decision_seconds += time.perf_counter() - start
        return predictions

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        start = time.perf_counter()
        requests = self.policy.planner.plan(predictions, view)
        self.decision_seconds += time.perf_counter() - start
        return requests

    def decide(self, layer_now: int, view: Callable[[int], CacheView]) -> list[TransferRequest]:
        """The engine's per-layer entry point: predict(layer_now), then the planner's requests against
        view(layer_now), the tier as it is then (nothing predicted: no request, no view built)."""
        predictions = self.predict(layer_now)
        return self.plan(predictions, view(layer_now)) if predictions else []

    def run_iteration(self, it: Iteration, mechanism: LayerMechanism) -> None:
        """One replayed iteration in the contract's order, the mechanism acting between the steps."""
        self.begin_iteration(it.ctx)
        mechanism.predicted(-1, self.predict(-1))
        for event in it.events:
            self.observe(event)
            mechanism.routed(event, it.ctx.num_tokens)
            mechanism.predicted(event.layer, self.predict(event.layer))
        for seq in it.finished:
            self.end_sequence(seq)

    def run(self, iterations: Iterable[Iteration], mechanism: LayerMechanism) -> None:
        for it in iterations:
            self.run_iteration(it, mechanism)


class TimedEviction(EvictionPolicy):
    """Forwards the cache's hooks to an eviction policy and adds up the time they take on `clock`
    (wall time by default; `time.thread_time` counts only this thread's CPU)."""

    def __init__(self, inner: EvictionPolicy, clock: Callable[[], float] = time.perf_counter):
        self.inner, self.clock = inner, clock
        self.seconds = 0.0

    def on_insert(self, key: ExpertKey) -> None:
        self._timed(self.inner.on_insert, key)

    def on_access(self, key: ExpertKey) -> None:
        self._timed(self.inner.on_access, key)

    def on_remove(self, key: ExpertKey) -> None:
        self._timed(self.inner.on_remove, key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        return self._timed(self.inner.victim, candidates)

    def _timed(self, hook, argument):
        start = self.clock()
        try:
            return hook(argument)
        finally:
            self.seconds += self.clock() - start
