"""The one place that calls a policy, in the order `moestream.contracts` gives, and times it.

Every consumer (simulator, predict-eval, benchmark, engine) goes through a `PolicyDriver`. `run_iteration`
walks a replayed `Iteration`, calling a `LayerMechanism` where the mechanism acts; the engine calls the
same steps one by one. Every call into the policy is a span of the tracer's lane "policy" (`TimedEviction`
does the same for a cache's eviction hooks). Knows the contract, not any policy, cache, link or clock.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence

from moestream.config import EngineConfig
from moestream.contracts import CacheView, EvictionPolicy, Observer, Policy, Prediction, TransferRequest
from moestream.events import IterationContext, RoutingEvent
from moestream.settings import default_of
from moestream.topology import ExpertKey
from moestream.trace.replay import Iteration
from moestream.tracer import Tracer


class LayerMechanism(Protocol):
    """What a replay does at the two points of a layer where the mechanism acts."""

    def routed(self, event: RoutingEvent, num_tokens: int) -> None:
        """Every observer has seen the layer's routing: serve its experts (hits, demand loads)."""

    def predicted(self, layer_now: int, predictions: list[Prediction]) -> None:
        """The predictions after layer_now (-1: before the first layer): plan, prefetch, compute."""


class PolicyDriver:
    def __init__(self, policy: Policy, evictions: Sequence[EvictionPolicy] = (),
                 observers: Sequence[Observer] = (), horizon_layers: int = default_of(EngineConfig, "horizon_layers"),
                 tracer: Tracer | None = None):
        """tracer: where each call into the policy is reported, lane "policy" (None: a totals-only one)."""
        self.policy = policy
        self.horizon_layers = horizon_layers
        self.observers: list[Observer] = [*policy.observers(), *evictions, *observers]
        self.tracer = tracer if tracer is not None else Tracer()

    def add_observer(self, observer: Observer) -> None:
        self.observers.append(observer)

    def begin_iteration(self, ctx: IterationContext) -> None:
        with self.tracer.span("policy", "begin iteration"):
            for observer in self.observers:
                observer.begin_iteration(ctx)

    def observe(self, event: RoutingEvent) -> None:
        with self.tracer.span("policy", lambda: f"observe layer {event.layer}"):
            for observer in self.observers:
                observer.observe(event)

    def end_sequence(self, seq_id: int) -> None:
        with self.tracer.span("policy", lambda: f"end sequence {seq_id}"):
            for observer in self.observers:
                observer.end_sequence(seq_id)

    def predict(self, layer_now: int) -> list[Prediction]:
        """The predictor's predictions for the horizon after layer_now (none with horizon 0)."""
        if not self.horizon_layers:
            return []
        with self.tracer.span("policy", lambda: f"predict after layer {layer_now}"):
            return self.policy.predictor.predict(layer_now, self.horizon_layers)

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        with self.tracer.span("policy", lambda: f"plan after layer {view.layer_now}"):
            return self.policy.planner.plan(predictions, view)

    def decide(self, layer_now: int, view: Callable[[int], CacheView]) -> list[TransferRequest]:
        """The engine's per-layer entry point, one span: predict, then plan against view(layer_now) (built
        only if something was predicted)."""
        requests: list[TransferRequest] = []
        with self.tracer.span("policy", lambda: f"after layer {layer_now}: {len(requests)} requests"):
            predictions = self.policy.predictor.predict(layer_now, self.horizon_layers) if self.horizon_layers else []
            if predictions:
                requests = self.policy.planner.plan(predictions, view(layer_now))
        return requests

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
    """Forwards the cache's hooks to an eviction policy, timing each in the tracer's lane "policy"."""

    def __init__(self, inner: EvictionPolicy, tracer: Tracer):
        self.inner, self.tracer = inner, tracer

    def on_insert(self, key: ExpertKey) -> None:
        self.tracer.call("policy", "on_insert", self.inner.on_insert, key)

    def on_access(self, key: ExpertKey) -> None:
        self.tracer.call("policy", "on_access", self.inner.on_access, key)

    def on_remove(self, key: ExpertKey) -> None:
        self.tracer.call("policy", "on_remove", self.inner.on_remove, key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        return self.tracer.call("policy", "victim", self.inner.victim, candidates)
