import numpy as np
import pytest

from moestream.bench.sim.replay import decode_stream
from moestream.contracts import CacheView, Prediction
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies import POLICIES
from moestream.policies.designs.expertflow import (
    CorrectionEviction,
    LayerOrderPlanner,
    batch_path_accuracy,
)
from moestream.policies.eviction import LRUPolicy
from moestream.policies.trained import PredictorFileError
from moestream.predictors.configs import RoutingPathConfig, TrainConfig
from moestream.predictors.paths import expert_mask, top_k_mask
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace

TOPOLOGY = Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=1)
SMALL = RoutingPathConfig(window_tokens=4, model_dim=32, num_heads=2, num_blocks=1, ff_dim=64, min_token_count=1)


def mapped_trace(num_sequences=48, length=12, vocab=16, seed=0) -> Trace:
    """Layer l's experts: one set by the token (0..3), one by the token before it (4..7)."""
    rng = np.random.default_rng(seed)
    by_current = rng.integers(0, 4, size=(vocab, TOPOLOGY.num_layers))
    by_previous = rng.integers(4, 8, size=(vocab + 1, TOPOLOGY.num_layers))  # row `vocab`: no previous token
    n = num_sequences * length
    tokens = rng.integers(0, vocab, size=n)
    positions = np.tile(np.arange(length), num_sequences)
    previous = np.where(positions > 0, np.roll(tokens, 1), vocab)
    experts = np.stack([by_current[tokens], by_previous[previous]], axis=-1).astype(np.int16)  # [N, L, 2]
    seq_ids = np.repeat(np.arange(num_sequences), length).astype(np.int32)
    positions, token_ids = positions.astype(np.int32), tokens.astype(np.int32)
    return Trace(TOPOLOGY, experts, seq_ids, positions, np.zeros(n, bool), token_ids=token_ids)


@pytest.fixture(scope="module")
def split():
    return mapped_trace().split(0.25, seed=0)


@pytest.fixture(scope="module")
def policy(split):
    train = TrainConfig(num_epochs=12, batch_size=32, learning_rate=1e-2)
    policy = POLICIES.create("expertflow", TOPOLOGY, config=SMALL, train=train)
    policy.fit(split[0])
    return policy


def test_model_learns_a_mapping_that_needs_the_token_context(policy, split):
    losses = policy.predictor.losses
    assert losses[-1] < 0.5 * losses[0]
    test = split[1]
    accuracy = policy.predictor.evaluate(test)["top-k accuracy (iteration start)"]
    popular = top_k_mask(expert_mask(split[0].experts, 8).mean(axis=0), 2)  # [L, E]
    actual = expert_mask(test.experts, 8)
    baseline = (actual & popular).sum() / actual.sum()
    # the token alone explains half of each path; the rest needs the token before it
    assert accuracy > 0.9 > baseline + 0.3


def test_training_is_deterministic_for_a_seed(split):
    def fit():
        policy = POLICIES.create("expertflow", TOPOLOGY, config=SMALL, train=TrainConfig(num_epochs=2, seed=5))
        policy.fit(split[0])
        return policy.predictor.losses, policy.predictor.trace_probabilities(split[1])

    (losses_a, probs_a), (losses_b, probs_b) = fit(), fit()
    assert losses_a == losses_b
    np.testing.assert_array_equal(probs_a, probs_b)


def _online_predictions(policy, trace):
    out = []
    for it in decode_stream(trace):
        policy.predictor.begin_iteration(it.ctx)
        out.append(policy.predictor.predict(-1, TOPOLOGY.num_layers))
        for seq in it.finished:
            policy.predictor.end_sequence(seq)
    return out


def test_save_load_round_trip_predicts_the_same(policy, split, tmp_path):
    policy.save(tmp_path / "ef")
    loaded = POLICIES.create("expertflow-nocorrect", TOPOLOGY, predictor_dir=tmp_path / "ef")
    loaded.fit(split[1])  # a loaded predictor is kept, not retrained
    assert _online_predictions(loaded, split[1]) == _online_predictions(policy, split[1])
    assert loaded.config == policy.config


def test_loading_refuses_another_model_shape_or_kind(policy, tmp_path):
    policy.save(tmp_path / "ef")
    other = Topology((1, 2), num_experts=8, top_k=2, expert_bytes=1)
    with pytest.raises(PredictorFileError, match="trained for"):
        POLICIES.create("expertflow", other, predictor_dir=tmp_path / "ef")
    with pytest.raises(PredictorFileError, match="expertflow-routing-path"):
        POLICIES.create("promoe-routing", TOPOLOGY, predictor_dir=tmp_path / "ef")
    with pytest.raises(PredictorFileError, match="missing"):
        POLICIES.create("expertflow", TOPOLOGY, predictor_dir=tmp_path / "nothing")
    (tmp_path / "ef" / "weights.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PredictorFileError, match="cannot read"):
        POLICIES.create("expertflow", TOPOLOGY, predictor_dir=tmp_path / "ef")


def test_online_predictions_match_batched_scoring(policy, split):
    test = split[1]
    online = _online_predictions(policy, test)
    for layer in range(TOPOLOGY.num_layers):
        scores = policy.predictor.score_rows(test, layer, 1)  # [N, E]
        best = top_k_mask(scores, 2)
        for row, predictions in enumerate(online):
            assert {p.expert for p in predictions if p.layer == layer} == set(np.flatnonzero(best[row]))


def test_a_batch_predicts_the_or_of_its_tokens_paths(policy, split):
    token_ids = split[1].token_ids[:3]

    def predicted(seq_ids, ids):
        ctx = IterationContext(0, np.asarray(seq_ids), np.zeros(len(ids), int), False, token_ids=np.asarray(ids))
        policy.predictor.reset()
        policy.predictor.begin_iteration(ctx)
        return policy.predictor.predict(-1, TOPOLOGY.num_layers)

    batch = predicted([7, 8, 9], token_ids)
    alone = set().union(*({(p.layer, p.expert) for p in predicted([i], [t])} for i, t in enumerate(token_ids)))
    assert {(p.layer, p.expert) for p in batch} == alone
    assert all(p.tokens_ahead == 0 and 0 < p.score <= 1 for p in batch)


def test_untrained_or_wrong_input_is_a_clear_error(policy):
    ctx = IterationContext(step=0, seq_ids=np.array([0]), positions=np.array([0]), is_prefill=False, tokens=("a",))
    with pytest.raises(MoestreamError, match="not trained"):
        POLICIES.create("expertflow", TOPOLOGY).predictor.begin_iteration(ctx)
    with pytest.raises(MoestreamError, match="token_ids"):
        policy.predictor.begin_iteration(ctx)


def test_planner_fills_capacity_nearest_layer_first_without_quota():
    predictions = [Prediction(1, e, 0.3) for e in range(4)] + [Prediction(2, e, 0.9 - 0.1 * e) for e in range(4)]
    resident = frozenset({ExpertKey(1, 0)})
    view = CacheView(resident, frozenset({ExpertKey(2, 3)}), capacity=5, layer_now=0, num_layers=3)
    plan = LayerOrderPlanner().plan(predictions, view)
    # all three missing experts of layer 1 (more than top_k: no per-layer quota), then layer 2 by score
    assert [tuple(r.key) for r in plan] == [(1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    priorities = [r.priority for r in plan]
    assert priorities == sorted(priorities, reverse=True) and len(set(priorities)) == 5 and 0 < priorities[-1] <= 1


class FixedScores:
    def __init__(self, scores):
        self.scores = scores

    def predicted_scores(self):
        return self.scores


def test_correction_evicts_unused_prefetches_then_computed_layers_then_unpredicted():
    scores = np.zeros((4, 4))
    scores[2, 0], scores[3, 1] = 0.9, 0.4
    policy = CorrectionEviction(FixedScores(scores))
    old = [ExpertKey(*key) for key in [(0, 1), (0, 0), (1, 0), (2, 1), (2, 0), (3, 0), (3, 1)]]
    for key in old:
        policy.on_insert(key)
    policy.begin_iteration(IterationContext(1, np.array([0]), np.array([5]), False))
    policy.on_insert(ExpertKey(1, 2))  # prefetched in this iteration
    policy.on_insert(ExpertKey(1, 3))  # prefetched in this iteration
    policy.on_insert(ExpertKey(1, 1))
    policy.observe(RoutingEvent(0, np.array([[0, 1]]), np.array([0]), np.array([5])))
    policy.on_access(ExpertKey(0, 0))
    policy.on_access(ExpertKey(0, 1))
    policy.observe(RoutingEvent(1, np.array([[1, 3]]), np.array([0]), np.array([5])))
    candidates = [*old, ExpertKey(1, 1), ExpertKey(1, 2), ExpertKey(1, 3)]
    order = []
    while candidates:
        victim = policy.victim(candidates)
        order.append(victim)
        candidates.remove(victim)
        policy.on_remove(victim)
    assert order == [
        ExpertKey(1, 2),  # prefetched for the current layer, not routed
        ExpertKey(1, 0),  # the current layer's other unrouted expert
        ExpertKey(0, 0), ExpertKey(0, 1),  # layer already computed, least recently used first
        ExpertKey(3, 0), ExpertKey(2, 1),  # later layers, not predicted, furthest first
        ExpertKey(3, 1), ExpertKey(2, 0),  # predicted, least likely first
        ExpertKey(1, 3), ExpertKey(1, 1),  # routed by the current layer
    ]


def test_nocorrect_ablation_evicts_by_recency():
    assert isinstance(POLICIES.create("expertflow-nocorrect", TOPOLOGY).make_eviction("device"), LRUPolicy)
    assert isinstance(POLICIES.create("expertflow", TOPOLOGY).make_eviction("device"), CorrectionEviction)


def test_batch_path_accuracy_on_a_hand_made_case():
    predicted = np.zeros((3, 1, 4), bool)
    actual = np.zeros((3, 1, 4), bool)
    predicted[0, 0, [0, 1]] = predicted[1, 0, [1, 2]] = predicted[2, 0, [0, 1]] = True
    actual[0, 0, [0, 3]] = actual[1, 0, [1, 3]] = actual[2, 0, [0, 1]] = True
    result = batch_path_accuracy(predicted, actual, [np.array([0, 1]), np.array([2])])
    # batch 1: OR predicted {0,1,2}, OR true {0,1,3}: 2 of 3 either way; batch 2: exact
    assert result.accuracy == pytest.approx((2 / 3 + 1) / 2)
    assert result.precision == pytest.approx((2 / 3 + 1) / 2)
    assert result.num_batches == 2
