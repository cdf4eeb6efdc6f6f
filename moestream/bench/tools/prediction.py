"""Offline accuracy of a predictor: precision, recall, F1 and GOODPRED of predicting each (token, layer)'s experts
D layers ahead, on a test trace replayed as one decode stream.

Horizon D >= 1: token t's layer l gets `predict(layer_now=l-D, horizon_layers=D)`, the call before t's first
layer when l-D = -1, and when l-D < -1 the call at layer L+l-D of the sequence's previous token (tokens_ahead=1;
a first token uses its own layer_now=-1 call). D = 0 (at the gate): the call before l routes, after a
GateInputObserver saw l's router input. The predicted set is the top_k experts by score > 0 (ties to the lower
id); a TraceScorer is scored a whole trace at a time by the same rule. GOODPRED (ProMoE) = precision x fetch_rate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator, Protocol, runtime_checkable

import numpy as np

from moestream.bench.sim.replay import decode_stream
from moestream.contracts import POLICIES, Prediction, Predictor
from moestream.errors import MoestreamError, TraceError
from moestream.events import RoutingEvent
from moestream.policies.driver import PolicyDriver
from moestream.trace.schema import Trace


class EvalError(MoestreamError):
    """An evaluation that cannot run as asked (horizon, traces, policy needs)."""


@runtime_checkable
class TraceScorer(Protocol):
    def score_rows(self, trace: Trace, layer: int, horizon_layers: int) -> np.ndarray:
        """[N, E]: scores for every row's `layer`, under this module's rule for horizon_layers >= 1."""


@runtime_checkable
class GateInputObserver(Protocol):
    def observe_gate_input(self, layer: int, hidden: np.ndarray) -> None:
        """Layer's router input [T, H], before it routes (used at horizon 0)."""


@dataclass
class PredictionCounts:
    hits: np.ndarray  # [L] predicted experts that were routed to
    predicted: np.ndarray  # [L] predicted experts
    actual: np.ndarray  # [L] routed experts

    def precision(self, layer: int | None = None) -> float:
        return _ratio(self._pick(self.hits, layer), self._pick(self.predicted, layer))

    def recall(self, layer: int | None = None) -> float:
        return _ratio(self._pick(self.hits, layer), self._pick(self.actual, layer))

    def f1(self, layer: int | None = None) -> float:
        p, r = self.precision(layer), self.recall(layer)
        return 0.0 if p + r == 0 else 2 * p * r / (p + r)

    @staticmethod
    def _pick(values: np.ndarray, layer: int | None) -> int:
        return int(values.sum() if layer is None else values[layer])


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def fetch_rate(horizon_layers: int, layer_compute_ms: float, transfer_ms: float, top_k: int) -> float:
    """Share of a top_k prediction that can arrive in time with horizon_layers of lead."""
    if horizon_layers <= 0:
        return 0.0
    return 1.0 if transfer_ms <= 0 else min(1.0, math.floor(horizon_layers * layer_compute_ms / transfer_ms) / top_k)


def check_horizon(horizon_layers: int, num_layers: int) -> None:
    if not 0 <= horizon_layers <= num_layers:
        raise EvalError(f"--horizon-layers must lie in [0, {num_layers}] (the MoE layers), got {horizon_layers}")


def evaluate_predictor(predictor: Predictor, test: Trace, horizon_layers: int) -> PredictionCounts:
    """Counts of the predictor's hits on `test` at the given horizon (the predictor is fitted)."""
    topology = test.topology
    check_horizon(horizon_layers, topology.num_layers)
    counts = PredictionCounts(*(np.zeros(topology.num_layers, dtype=np.int64) for _ in range(3)))
    at_gate = horizon_layers == 0 and isinstance(predictor, GateInputObserver) and test.hidden is not None
    if isinstance(predictor, TraceScorer) and not at_gate:  # the whole trace at a time, by the same rule
        k = topology.top_k
        for layer in range(topology.num_layers):
            scores = predictor.score_rows(test, layer, max(1, horizon_layers))  # [N, E]
            top = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # [N, k]
            kept = np.take_along_axis(scores, top, axis=1) > 0  # [N, k]
            hit = (top[:, :, None] == test.experts[:, layer][:, None, :]).any(axis=2) & kept  # experts [N, K]
            counts.hits[layer] += int(hit.sum())
            counts.predicted[layer] += int(kept.sum())
            counts.actual[layer] += test.num_tokens * k
    else:
        sets = _gate_sets(predictor, test) if horizon_layers == 0 else _ahead_sets(predictor, test, horizon_layers)
        for row, by_layer in sets:
            for layer, predicted in by_layer.items():
                actual = test.experts[row, layer]
                counts.hits[layer] += int(np.isin(predicted, actual).sum())
                counts.predicted[layer] += len(predicted)
                counts.actual[layer] += len(actual)
    return counts


def top_experts(predictions: list[Prediction], layer: int, tokens_ahead: int, k: int) -> np.ndarray:
    """The k best-scored experts predicted for (layer, tokens_ahead), ties to the lower id."""
    best: dict[int, float] = {}
    for p in predictions:
        if p.layer == layer and p.tokens_ahead == tokens_ahead and p.score > 0:
            best[p.expert] = max(p.score, best.get(p.expert, 0.0))
    ranked = sorted(best, key=lambda expert: (-best[expert], expert))
    return np.asarray(ranked[:k], dtype=np.int64)


class _AheadSets:
    """The LayerMechanism that collects each token's predicted sets D layers ahead (horizon >= 1)."""

    def __init__(self, topology, horizon: int):
        self.num_layers, self.k, self.horizon = topology.num_layers, topology.top_k, horizon
        self.pending: dict[int, dict[int, np.ndarray]] = {}  # seq -> sets for its next token's first layers
        self.sets: dict[int, np.ndarray] = {}
        self.upcoming: dict[int, np.ndarray] = {}

    def start(self, seq: int) -> None:
        self.carried, self.sets, self.upcoming = self.pending.pop(seq, None), {}, {}

    def routed(self, event: RoutingEvent, num_tokens: int) -> None:
        pass

    def predicted(self, layer_now: int, predictions: list[Prediction]) -> None:
        if layer_now < 0:
            self.sets = {layer: top_experts(predictions, layer, 0, self.k) for layer in range(min(self.horizon, self.num_layers))}
            if self.carried is not None:
                self.sets.update(self.carried)
            return
        target = layer_now + self.horizon
        if target < self.num_layers:
            self.sets[target] = top_experts(predictions, target, 0, self.k)
        elif target - self.num_layers < self.horizon - 1:
            self.upcoming[target - self.num_layers] = top_experts(predictions, target - self.num_layers, 1, self.k)


def _ahead_sets(predictor: Predictor, test: Trace, horizon: int) -> Iterator[tuple[int, dict[int, np.ndarray]]]:
    """(row, {layer: predicted experts}) for every token of the decode stream, horizon >= 1."""
    alone = SimpleNamespace(predictor=predictor, observers=lambda: [predictor])  # the predictor as a policy
    driver = PolicyDriver(alone, horizon_layers=horizon)
    collect = _AheadSets(test.topology, horizon)
    for it in decode_stream(test):
        seq = int(it.ctx.seq_ids[0])
        collect.start(seq)
        driver.run_iteration(it, collect)
        collect.pending[seq] = collect.upcoming
        for finished in it.finished:
            collect.pending.pop(finished, None)
        yield int(it.rows[0]), collect.sets


def _gate_sets(predictor: Predictor, test: Trace) -> Iterator[tuple[int, dict[int, np.ndarray]]]:
    """(row, {layer: predicted experts}) at the gate: the router input of l, never its routing."""
    k = test.topology.top_k
    reads_gate = isinstance(predictor, GateInputObserver)
    for it in decode_stream(test):
        predictor.begin_iteration(it.ctx)
        sets = {}
        for event in it.events:
            if reads_gate and event.hidden is not None:
                predictor.observe_gate_input(event.layer, event.hidden)
            sets[event.layer] = top_experts(predictor.predict(event.layer - 1, 1), event.layer, 0, k)
            predictor.observe(event)
        for finished in it.finished:
            predictor.end_sequence(finished)
        yield int(it.rows[0]), sets


def check_compatible(train: Trace, test: Trace, needs: tuple[str, ...], name: str) -> None:
    if train.topology != test.topology:
        ours, theirs = train.topology.routing_shape(), test.topology.routing_shape()
        if ours == theirs:  # the layers' ids or the experts' sizes differ
            ours, theirs = train.topology, test.topology
        raise TraceError(f"train and test traces have different topologies: {ours} vs {theirs}")
    for which, trace in (("train", train), ("test", test)):
        missing = [field for field in needs if getattr(trace, field, None) is None]
        if missing:
            raise EvalError(f"policy {name!r} needs {', '.join(missing)} in the {which} trace")


def summarize(counts: PredictionCounts, horizon_layers: int, rate: float) -> dict:
    precision, layers = counts.precision(), range(len(counts.hits))
    return {"horizon_layers": horizon_layers, "precision": precision, "recall": counts.recall(), "f1": counts.f1(),
            "goodpred": precision * rate, "fetch_rate": rate, "num_predicted": int(counts.predicted.sum()),
            "per_layer_f1": [counts.f1(layer) for layer in layers],
            "per_layer_precision": [counts.precision(layer) for layer in layers],
            "per_layer_recall": [counts.recall(layer) for layer in layers]}


@dataclass(frozen=True)
class LeadTimeCost:
    """What GOODPRED needs of a cost model: compute per layer, transfer of one expert."""

    layer_compute_ms: float
    transfer_ms: float

    def __post_init__(self):
        if self.layer_compute_ms < 0 or self.transfer_ms < 0:
            raise EvalError("layer_compute_ms and transfer_ms must be >= 0")


def evaluate_policy(name: str, train: Trace, test: Trace, horizon_layers: int, cost: LeadTimeCost,
                    **policy_kwargs) -> dict:
    """Fit policy `name` (built with policy_kwargs) on train, evaluate its predictor on test."""
    check_horizon(horizon_layers, test.topology.num_layers)
    policy_class = POLICIES.get(name)
    check_compatible(train, test, policy_class.trace_needs, name)
    if not train.num_tokens or not test.num_tokens:
        raise EvalError("the train and test traces must both hold tokens")
    policy = policy_class(test.topology, **policy_kwargs)
    policy.fit(train)
    policy.prepare(test)
    counts = evaluate_predictor(policy.predictor, test, horizon_layers)
    rate = fetch_rate(horizon_layers, cost.layer_compute_ms, cost.transfer_ms, test.topology.top_k)
    return {"predictor": name, "num_tokens": test.num_tokens} | summarize(counts, horizon_layers, rate)


def split_trace(trace: Trace, fraction: float, seed: int):
    """(train, test): a seeded --test-fraction of the trace's sequences held out, neither side empty."""
    if not 0.0 < fraction < 1.0:
        raise EvalError(f"--test-fraction must lie in (0, 1), got {fraction}")
    if len(trace.sequence_ids()) < 2:
        raise EvalError("--test-fraction needs a trace with at least two sequences")
    train, test = trace.split(fraction, seed)
    if not train.num_tokens:
        raise EvalError(f"--test-fraction {fraction} leaves no sequence to train on")
    return train, test
