"""The static, cooccur, token and token-cooccur baselines on traces whose structure is known."""

import dataclasses

import numpy as np
import pytest

from moestream.bench.sim.replay import decode_stream, iteration
from moestream.errors import TraceError
from moestream.events import IterationContext
from moestream.policies import POLICIES
from moestream.policies.baselines.predictive import (
    BaselineConfig,
    CooccurPredictor,
    NotFittedError,
    PinnedLRU,
    TokenPredictor,
)
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=1)


def chain_trace(num_sequences=30, length=10, seed=0):
    """Layer l+1's experts are layer l's plus one (mod 8); a token's first layer is random."""
    rng = np.random.default_rng(seed)
    n = num_sequences * length
    experts = np.empty((n, 4, 2), dtype=np.int16)
    first = rng.integers(0, 8, size=n)
    for layer in range(4):
        experts[:, layer, 0] = (first + layer) % 8
        experts[:, layer, 1] = (first + layer + 4) % 8
    return _trace(experts, num_sequences, length)


def token_trace(num_sequences=20, length=12, seed=0):
    """Token v routes to experts {v, v+1} + layer (mod 8) at every layer."""
    rng = np.random.default_rng(seed)
    n = num_sequences * length
    token_ids = rng.integers(0, 5, size=n)
    experts = np.stack([np.stack([(token_ids + l) % 8, (token_ids + l + 1) % 8], axis=1) for l in range(4)], axis=1)
    return _trace(experts.astype(np.int16), num_sequences, length, token_ids)


def _trace(experts, num_sequences, length, token_ids=None):
    return Trace(
        topology=TOPOLOGY,
        experts=experts,
        seq_ids=np.repeat(np.arange(num_sequences), length).astype(np.int32),
        positions=np.tile(np.arange(length), num_sequences).astype(np.int32),
        is_prefill=np.zeros(len(experts), bool),
        token_ids=None if token_ids is None else token_ids.astype(np.int32),
        tokens=None if token_ids is None else [f"w{t}" for t in token_ids],
    )


def _fitted(name, trace):
    policy = POLICIES.create(name, TOPOLOGY)
    policy.fit(trace)
    return policy.predictor


def _top(predictions, layer, tokens_ahead=0, k=2):
    chosen = [p for p in predictions if p.layer == layer and p.tokens_ahead == tokens_ahead]
    return {p.expert for p in sorted(chosen, key=lambda p: -p.score)[:k]}


def test_cooccur_follows_a_deterministic_chain():
    trace = chain_trace()
    predictor = _fitted("cooccur", trace)
    for it in list(decode_stream(trace))[:20]:
        predictor.begin_iteration(it.ctx)
        for event in it.events[:2]:
            predictor.observe(event)
        predictions = predictor.predict(1, 2)
        for layer in (2, 3):
            assert _top(predictions, layer) == set(trace.experts[it.rows[0], layer].tolist())


def test_cooccur_reaches_the_next_token_only_through_tokens_ahead():
    predictor = _fitted("cooccur", chain_trace())
    it = next(decode_stream(chain_trace(seed=1)))
    predictor.begin_iteration(it.ctx)
    for event in it.events:
        predictor.observe(event)
    predictions = predictor.predict(3, 2)
    assert {(p.layer, p.tokens_ahead) for p in predictions} == {(0, 1), (1, 1)}


def test_token_frequencies_predict_every_layer_before_the_first():
    predictor = _fitted("token", token_trace())
    for it in list(decode_stream(token_trace(seed=1)))[:15]:
        predictor.begin_iteration(it.ctx)
        predictions = predictor.predict(-1, 4)
        for layer in range(4):
            token = int(it.ctx.token_ids[0])
            assert _top(predictions, layer) == {(token + layer) % 8, (token + layer + 1) % 8}


def test_token_uses_strings_when_the_trace_has_no_ids():
    strings_only = dataclasses.replace(token_trace(), token_ids=None)
    predictor = _fitted("token", strings_only)
    ctx = IterationContext(0, np.array([0]), np.array([0]), False, tokens=("w3",))
    predictor.begin_iteration(ctx)
    assert _top(predictor.predict(-1, 1), 0) == {3, 4}


def test_token_unseen_tokens_and_the_next_token_get_layer_popularity():
    trace = token_trace()
    predictor = _fitted("token", trace)
    predictor.begin_iteration(IterationContext(0, np.array([0]), np.array([0]), False, token_ids=np.array([999])))
    unseen = predictor.predict(-1, 1)
    popularity = np.bincount(trace.experts[:, 0].ravel(), minlength=8) / trace.num_tokens
    assert [p.expert for p in unseen][:2] == list(np.argsort(-popularity, kind="stable")[:2])
    ahead = predictor.predict(3, 1)
    assert all(p.tokens_ahead == 1 for p in ahead)


def test_token_needs_ids_or_strings():
    trace = dataclasses.replace(chain_trace(), token_ids=None, tokens=None)
    with pytest.raises(TraceError, match="token ids or token strings"):
        _fitted("token", trace)


def test_token_cooccur_predicts_the_next_layer():
    trace = token_trace()
    predictor = _fitted("token-cooccur", trace)
    it = next(decode_stream(token_trace(seed=4)))
    predictor.begin_iteration(it.ctx)
    predictor.observe(it.events[0])
    truth = set(it.events[1].expert_ids[0].tolist())
    assert _top(predictor.predict(0, 1), 1) == truth


def test_static_predicts_and_pins_the_most_popular_experts():
    trace = synthetic_trace(TOPOLOGY, num_sequences=6, tokens_per_sequence=10, seed=5)
    policy = POLICIES.create("static", TOPOLOGY)
    policy.fit(trace)
    predictor = policy.predictor
    popularity = np.stack([np.bincount(trace.experts[:, l].ravel(), minlength=8) for l in range(4)]) / trace.num_tokens
    predictor.begin_iteration(next(decode_stream(trace)).ctx)
    for p in predictor.predict(-1, 4):
        assert p.expert in np.argsort(-popularity[p.layer], kind="stable")[:2]
        assert p.score == pytest.approx(popularity[p.layer, p.expert])
    pinned = predictor.pinned()
    assert len(pinned) == 8
    eviction = policy.make_eviction("device")
    keys = [ExpertKey(0, e) for e in range(8)]
    for key in keys:
        eviction.on_insert(key)
    free = [k for k in keys if k not in pinned]
    assert eviction.victim(keys) == free[0]
    only_pinned = [k for k in keys if k in pinned]
    assert eviction.victim(only_pinned) in only_pinned


def test_pinned_lru_reads_the_pinned_set_when_it_chooses():
    pinned = set()
    policy = PinnedLRU(lambda: frozenset(pinned))
    keys = [ExpertKey(0, e) for e in range(3)]
    for key in keys:
        policy.on_insert(key)
    assert policy.victim(keys) == keys[0]
    pinned.add(keys[0])
    assert policy.victim(keys) == keys[1]


def test_batch_scores_are_the_union_of_the_rows():
    trace = token_trace()
    predictor = _fitted("token", trace)
    single = {}
    for token in (1, 3):
        predictor.begin_iteration(IterationContext(0, np.array([0]), np.array([0]), False, token_ids=np.array([token])))
        single[token] = {p.expert: p.score for p in predictor.predict(-1, 1)}
    predictor.begin_iteration(IterationContext(1, np.array([0, 1]), np.array([0, 0]), False, token_ids=np.array([1, 3])))
    batch = {p.expert: p.score for p in predictor.predict(-1, 1)}
    for expert, score in batch.items():
        a, b = single[1].get(expert, 0.0), single[3].get(expert, 0.0)
        assert score >= max(a, b) - 1e-12


def test_unfitted_predictors_predict_nothing_and_refuse_to_score():
    predictor = CooccurPredictor(TOPOLOGY)
    predictor.begin_iteration(next(decode_stream(chain_trace())).ctx)
    assert predictor.predict(-1, 2) == []
    with pytest.raises(NotFittedError):
        predictor.score_rows(chain_trace(), 0, 1)


def test_candidates_per_layer_are_capped():
    predictor = TokenPredictor(TOPOLOGY, BaselineConfig(num_candidates_per_layer=3))
    predictor.fit(token_trace())
    predictor.begin_iteration(next(decode_stream(token_trace())).ctx)
    predictions = predictor.predict(-1, 2)
    assert max(sum(p.layer == l for p in predictions) for l in (0, 1)) <= 3


def test_calibrated_scores_match_frequencies_on_held_out_tokens():
    trace = synthetic_trace(TOPOLOGY, num_sequences=60, tokens_per_sequence=20, seed=7)
    train, test = trace.split(0.3, seed=0)
    predictor = _fitted("token-cooccur", train)
    scores = np.concatenate([predictor.score_rows(test, layer, 1) for layer in range(4)])  # [4N, E]
    routed = np.concatenate([np.eye(8, dtype=bool)[test.experts[:, layer]].any(axis=1) for layer in range(4)])
    assert abs(scores.sum(axis=1).mean() - 2.0) < 0.4  # expected experts per token = top_k
    confident = scores > 0.5
    assert routed[confident].mean() > 0.5 and routed[~confident].mean() < 0.5


def test_config_is_validated():
    with pytest.raises(ValueError):
        BaselineConfig(num_source_layers=0)
    with pytest.raises(ValueError):
        BaselineConfig(token_prior_weight=0)


def test_prefill_iterations_score_every_token():
    trace = token_trace()
    predictor = _fitted("cooccur", trace)
    it = iteration(trace, np.arange(6), step=0)
    predictor.begin_iteration(it.ctx)
    predictor.observe(it.events[0])
    predictions = predictor.predict(0, 1)
    assert predictions and all(0 <= p.score <= 1 for p in predictions)
