"""predict-eval's rule: which call's prediction counts for each (token, layer), and its metrics."""

import dataclasses

import numpy as np
import pytest

from moestream.bench.tools.prediction import (
    EvalError,
    LeadTimeCost,
    evaluate_policy,
    evaluate_predictor,
    fetch_rate,
)
from moestream.contracts import Prediction, Predictor
from moestream.errors import TraceError
from moestream.policies import POLICIES
from moestream.topology import Topology
from tests.policies.online import OnlineOnly
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4, 5), num_experts=8, top_k=2, expert_bytes=1000)
BASELINES = ("static", "cooccur", "token", "token-cooccur")


@pytest.fixture(scope="module")
def split():
    trace = synthetic_trace(TOPOLOGY, num_sequences=14, tokens_per_sequence=9, seed=1)
    return trace.split(0.3, seed=0)


class CopyLast(Predictor):
    """Predicts, for every future position, the experts of the last layer it observed."""

    def __init__(self, topology):
        super().__init__(topology)
        self.last = None

    def observe(self, event):
        self.last = event.expert_ids[0]

    def end_sequence(self, seq_id):
        self.last = None

    def predict(self, layer_now, horizon_layers):
        if self.last is None:
            return []
        out = []
        for target in range(layer_now + 1, layer_now + horizon_layers + 1):
            ahead, layer = divmod(target, self.topology.num_layers)
            out += [Prediction(layer, int(e), 1.0, ahead) for e in self.last]
        return out


def _expected_copy_hits(trace, horizon):
    """Hits of CopyLast under the rule, computed directly from the trace's positions."""
    num_layers = trace.topology.num_layers
    hits = predicted = 0
    first_of_seq = np.r_[True, trace.seq_ids[1:] != trace.seq_ids[:-1]]
    for row in range(trace.num_tokens):
        for layer in range(num_layers):
            source = row * num_layers + layer - horizon  # stream position of the call
            source_row, source_layer = divmod(source, num_layers)
            seq_start = row - trace.positions[row]
            if source_row < seq_start or (source_row < row and first_of_seq[row] and layer - horizon < -1):
                continue
            copied = trace.experts[source_row, source_layer]
            hits += np.isin(copied, trace.experts[row, layer]).sum()
            predicted += len(copied)
    return hits, predicted


@pytest.mark.parametrize("horizon", [1, 2, 4, 5])
def test_rule_takes_the_call_made_horizon_positions_earlier(split, horizon):
    _, test = split
    counts = evaluate_predictor(CopyLast(TOPOLOGY), test, horizon)
    assert (counts.hits.sum(), counts.predicted.sum()) == _expected_copy_hits(test, horizon)
    assert counts.actual.sum() == test.num_tokens * 5 * 2


@pytest.mark.parametrize("name", BASELINES)
def test_vectorised_scores_equal_the_event_loop(split, name):
    train, test = split
    for horizon in (0, 1, 3, 5):
        policy = POLICIES.create(name, TOPOLOGY)
        policy.fit(train)
        fast = evaluate_predictor(policy.predictor, test, horizon)
        slow = evaluate_predictor(OnlineOnly(policy.predictor), test, horizon)
        for field in ("hits", "predicted", "actual"):
            np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field), err_msg=f"{field} D={horizon}")


class GateReader(Predictor):
    """Reads the router input of the layer about to route (here a one-hot of its experts)."""

    def __init__(self, topology):
        super().__init__(topology)
        self.gate = None

    def observe_gate_input(self, layer, hidden):
        self.gate = (layer, np.flatnonzero(hidden[0] > 0.5))

    def predict(self, layer_now, horizon_layers):
        if self.gate is None or self.gate[0] != layer_now + 1:
            return []
        return [Prediction(self.gate[0], int(e), 1.0) for e in self.gate[1]]


def test_horizon_zero_sees_the_router_input_but_not_the_routing(split):
    _, test = split
    hidden = np.zeros((test.num_tokens, 5, 8), np.float16)
    np.put_along_axis(hidden, test.experts.astype(int), 1.0, axis=2)
    with_gate = dataclasses.replace(test, hidden=hidden)
    assert evaluate_predictor(GateReader(TOPOLOGY), with_gate, 0).f1() == 1.0
    assert evaluate_predictor(GateReader(TOPOLOGY), with_gate, 1).f1() == 0.0
    assert evaluate_predictor(GateReader(TOPOLOGY), test, 0).predicted.sum() == 0


def test_fetch_rate():
    assert fetch_rate(0, 1.0, 0.1, 6) == 0.0
    assert fetch_rate(1, 0.25, 0.7, 6) == 0.0
    assert fetch_rate(3, 0.25, 0.7, 6) == pytest.approx(1 / 6)
    assert fetch_rate(2, 1.0, 0.5, 2) == 1.0
    assert fetch_rate(2, 1.0, 0.0, 2) == 1.0


def test_evaluate_policy_summary(split):
    train, test = split
    cost = LeadTimeCost(layer_compute_ms=1.0, transfer_ms=1.0)
    result = evaluate_policy("token-cooccur", train, test, 1, cost)
    assert result["predictor"] == "token-cooccur" and result["num_tokens"] == test.num_tokens
    assert len(result["per_layer_f1"]) == 5
    for key in ("precision", "recall", "f1", "goodpred"):
        assert 0.0 <= result[key] <= 1.0
    assert result["fetch_rate"] == 0.5 and result["goodpred"] == pytest.approx(result["precision"] * 0.5)


def test_token_baselines_beat_static_on_token_driven_routing():
    trace = synthetic_trace(TOPOLOGY, num_sequences=40, tokens_per_sequence=20, vocab_size=10, seed=1)
    train, test = trace.split(0.3, seed=0)
    cost = LeadTimeCost(1.0, 1.0)
    f1 = {name: evaluate_policy(name, train, test, 1, cost)["f1"] for name in BASELINES}
    assert f1["token"] > f1["static"] and f1["token-cooccur"] > f1["static"]


def test_bad_requests(split):
    train, test = split
    cost = LeadTimeCost(1.0, 1.0)
    with pytest.raises(EvalError, match="horizon-layers"):
        evaluate_policy("cooccur", train, test, 6, cost)
    other = synthetic_trace(Topology((1, 2), 8, 2, 1000), num_sequences=2, tokens_per_sequence=3)
    with pytest.raises(TraceError, match="different topologies"):
        evaluate_policy("cooccur", other, test, 1, cost)
    with pytest.raises(KeyError, match="unknown policy"):
        evaluate_policy("no-such", train, test, 1, cost)


def test_missing_trace_fields_are_named(split):
    train, test = split
    needs = [name for name in POLICIES.names() if "hidden" in POLICIES.get(name).trace_needs]
    if not needs:
        pytest.skip("no registered policy needs hidden states")
    with pytest.raises(EvalError, match="needs hidden"):
        evaluate_policy(needs[0], train, test, 1, LeadTimeCost(1.0, 1.0))


def test_real_trace_split_orders_the_baselines(deepseek_dev_path):
    from moestream.trace.format import load_trace

    trace = load_trace(deepseek_dev_path)
    small = trace.select(trace.sequence_ids()[:200])
    train, test = small.split(0.2, seed=0)
    cost = LeadTimeCost(0.25, 0.7)
    f1 = {name: evaluate_policy(name, train, test, 1, cost)["f1"] for name in BASELINES}
    assert f1["cooccur"] > f1["static"] and f1["token"] > f1["static"]
    assert f1["token-cooccur"] > max(f1["cooccur"], f1["token"])
