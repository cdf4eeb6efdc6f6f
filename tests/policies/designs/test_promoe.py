
import numpy as np
import pytest

from moestream.bench.sim.replay import decode_stream
from moestream.bench.tools.goodpred import goodpred_table
from moestream.contracts import CacheView, Prediction
from moestream.errors import MoestreamError, TraceError
from moestream.events import RoutingEvent
from moestream.policies import POLICIES
from moestream.policies.designs.promoe import PromoeConfig, SpeculativePlanner
from moestream.predictors.configs import TrainConfig
from moestream.predictors.paths import expert_mask, top_k_mask
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace

TOPOLOGY = Topology((1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=1)
CONFIG = PromoeConfig(num_distances=2, hidden_units=32)
TRAIN = TrainConfig(num_epochs=12, batch_size=32, learning_rate=1e-2)


def random_routing(n: int, rng) -> np.ndarray:
    return np.argsort(rng.random((n, TOPOLOGY.num_layers, 8)), axis=-1)[..., :2].astype(np.int16)  # [N, L, 2]


def make_trace(experts: np.ndarray, length: int = 16, hidden: np.ndarray | None = None) -> Trace:
    n = len(experts)
    positions = np.tile(np.arange(length), n // length).astype(np.int32)
    seq_ids = np.repeat(np.arange(n // length), length).astype(np.int32)
    return Trace(TOPOLOGY, experts, seq_ids, positions, np.zeros(n, bool), hidden=hidden)


def hidden_trace(num_tokens=640, width=16, seed=0) -> Trace:
    """Uniform routing; each layer's router input is a noisy linear code of the next two layers' experts."""
    rng = np.random.default_rng(seed)
    experts = random_routing(num_tokens, rng)
    hot = expert_mask(experts, 8).astype(np.float32)  # [N, L, E]
    pad = np.zeros((num_tokens, 2, 8), np.float32)
    ahead1, ahead2 = np.concatenate([hot[:, 1:], pad[:, :1]], 1), np.concatenate([hot[:, 2:], pad], 1)
    code1, code2 = rng.standard_normal((8, width)), rng.standard_normal((8, width))
    hidden = ahead1 @ code1 + ahead2 @ code2 + 0.1 * rng.standard_normal((num_tokens, TOPOLOGY.num_layers, width))
    return make_trace(experts, hidden=hidden.astype(np.float16))


def shifted_trace(num_tokens=640, seed=1) -> Trace:
    """Layer l+1 routes to layer l's experts shifted by one: learnable from routing alone."""
    experts = random_routing(num_tokens, np.random.default_rng(seed))
    for layer in range(1, TOPOLOGY.num_layers):
        experts[:, layer] = (experts[:, layer - 1] + 1) % 8
    return make_trace(experts)


@pytest.fixture(scope="module")
def hidden_split():
    return hidden_trace().split(0.25, seed=0)


@pytest.fixture(scope="module")
def promoe(hidden_split):
    policy = POLICIES.create("promoe", TOPOLOGY, config=CONFIG, train=TRAIN)
    policy.fit(hidden_split[0])
    return policy


def test_promoe_refuses_a_trace_without_hidden_states():
    with pytest.raises(TraceError, match="'hidden'"):
        POLICIES.create("promoe", TOPOLOGY, config=CONFIG, train=TRAIN).fit(shifted_trace())
    assert POLICIES.get("promoe").trace_needs == ("hidden",)


def test_promoe_learns_future_routing_encoded_in_hidden_states(promoe, hidden_split):
    losses = promoe.predictor.losses
    assert losses[-1] < 0.5 * losses[0]
    figures = promoe.predictor.evaluate(hidden_split[1])
    chance = TOPOLOGY.top_k / TOPOLOGY.num_experts  # routing is uniform
    assert figures["top-k accuracy (k=1)"] > 0.9 > chance + 0.5
    assert figures["top-k accuracy (k=2)"] > 0.9


def test_promoe_online_needs_the_router_input(promoe):
    promoe.predictor.begin_iteration(None)
    with pytest.raises(MoestreamError, match="hidden"):
        promoe.predictor.observe(RoutingEvent(0, np.array([[0, 1]]), np.array([0]), np.array([0])))


def test_routing_variant_learns_from_earlier_layers_routing():
    train, test = shifted_trace().split(0.25, seed=0)
    policy = POLICIES.create("promoe-routing", TOPOLOGY, config=CONFIG, train=TRAIN)
    policy.fit(train)
    assert policy.predictor.evaluate(test)["top-k accuracy (k=1)"] > 0.9


def _online(policy, trace, horizon):
    """Per token, per observed layer: the set of (layer, expert) predicted."""
    out = []
    for it in decode_stream(trace):
        policy.predictor.begin_iteration(it.ctx)
        for event in it.events:
            policy.predictor.observe(event)
            out.append({(p.layer, p.expert, round(p.score, 6)) for p in policy.predictor.predict(event.layer, horizon)})
    return out


def test_save_load_round_trip_predicts_the_same(promoe, hidden_split, tmp_path):
    promoe.save(tmp_path / "p")
    loaded = POLICIES.create("promoe", TOPOLOGY, config=PromoeConfig(speculative_priority=0.25), predictor_dir=tmp_path / "p")
    test = hidden_split[1]
    assert _online(loaded, test, 3) == _online(promoe, test, 3)
    assert loaded.config.speculative_priority == 0.25  # the priority band stays the policy's own
    assert loaded.config.num_distances == CONFIG.num_distances


def test_online_predictions_match_batched_scoring(promoe, hidden_split):
    test = hidden_split[1]
    online = _online(promoe, test, 1)
    layers = TOPOLOGY.num_layers
    for target in range(1, layers):
        best = top_k_mask(promoe.predictor.score_rows(test, target, 1), 2)  # [N, E]
        for row in range(test.num_tokens):
            predicted = {expert for layer, expert, _ in online[row * layers + target - 1] if layer == target}
            assert predicted == set(np.flatnonzero(best[row]))
    assert not promoe.predictor.score_rows(test, 0, 1).any()  # nothing predicts the first layer
    assert not promoe.predictor.score_rows(test, 3, 3).any()  # beyond the trained distances


def test_speculative_planner_stays_in_its_low_band():
    predictions = [Prediction(2, 0, 0.9), Prediction(1, 1, 0.9), Prediction(1, 2, 0.2), Prediction(1, 3, 1.0)]
    view = CacheView(frozenset({ExpertKey(1, 3)}), frozenset(), capacity=2, layer_now=0, num_layers=4)
    plan = SpeculativePlanner(0.5).plan(predictions, view)
    assert [r.key for r in plan] == [ExpertKey(1, 1), ExpertKey(2, 0)]
    assert all(0 < r.priority <= 0.5 for r in plan)


def test_goodpred_is_accuracy_times_fetch_rate(promoe, hidden_split):
    table = goodpred_table(promoe.predictor, hidden_split[1], layer_compute_ms=1.0, transfer_ms=1.0)
    assert {(row.layer, row.distance) for row in table} == {(i, k) for k in (1, 2) for i in range(k, 4)}
    for row in table:
        assert row.goodpred == pytest.approx(row.accuracy * row.fetch_rate)
        assert 0.9 < row.accuracy <= 1.0
    rate = {row.distance: row.fetch_rate for row in table}
    assert rate[1] < rate[2] <= 1.0  # a longer lead fetches more of the prediction in time
