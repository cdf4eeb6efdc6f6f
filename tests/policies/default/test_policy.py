"""The default policy: fit, online predictions equal to whole-trace scoring, calibration, eviction
by expected next use, save/load, traces without tokens or with gate probabilities, real data."""

import dataclasses

import numpy as np
import pytest

from moestream.cache import ExpertCache
from moestream.eval.prediction import evaluate_predictor
from moestream.policies import POLICIES
from moestream.policies.contracts import CacheView, Prediction
from moestream.policies.default.policy import DefaultConfig
from moestream.policies.default.model import RoutingWeights
from moestream.predictors.configs import TrainConfig
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import decode_stream, iteration
from moestream.trace.synthetic import synthetic_trace
from tests.policies.online import OnlineOnly

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4, 5), num_experts=8, top_k=2, expert_bytes=1024)
SMALL = DefaultConfig(hidden_dim=32, reuse_tokens=200, min_train_steps=0)
QUICK = TrainConfig(num_epochs=8, learning_rate=1e-2, batch_size=64)


def fitted(trace, config=SMALL, train=QUICK):
    policy = POLICIES.create("default", TOPOLOGY, config=config, train=train)
    policy.fit(trace)
    return policy


@pytest.fixture(scope="module")
def traces():
    return synthetic_trace(TOPOLOGY, num_sequences=30, tokens_per_sequence=20, seed=1).split(0.3, seed=0)


@pytest.fixture(scope="module")
def policy(traces):
    return fitted(traces[0])


@pytest.mark.parametrize("horizon", [1, 2, 4])
def test_online_predictions_match_whole_trace_scoring(policy, traces, horizon):
    test = traces[1]
    fast = evaluate_predictor(policy.predictor, test, horizon)
    policy.predictor.reset()
    slow = evaluate_predictor(OnlineOnly(policy.predictor), test, horizon)
    assert np.abs(fast.hits - slow.hits).sum() <= 0.01 * fast.hits.sum()
    assert (fast.predicted == slow.predicted).all()


def test_learned_predictions_beat_popularity(policy, traces):
    train, test = traces
    counts = evaluate_predictor(policy.predictor, test, 1)
    popular = np.argsort(-np.stack([np.bincount(train.experts[:, l].ravel(), minlength=8) for l in range(5)]), axis=1)[:, :2]
    hits = sum(np.isin(popular[l], test.experts[i, l]).sum() for i in range(test.num_tokens) for l in range(5))
    assert counts.hits.sum() > hits


def test_scores_are_calibrated_probabilities(policy, traces):
    test = traces[1]
    scores = np.stack([policy.predictor.score_rows(test, layer, 1) for layer in range(5)], axis=1)  # [N, L, E]
    routed = np.zeros_like(scores, dtype=bool)
    np.put_along_axis(routed, test.experts.astype(np.int64), True, axis=2)
    assert 0.0 <= scores.min() and scores.max() <= 1.0
    # expected number of routed experts per (token, layer) is close to top_k
    assert abs(scores.sum(axis=2).mean() - TOPOLOGY.top_k) < 0.5
    confident = scores > 0.5
    assert routed[confident].mean() > routed[~confident].mean()


def test_eviction_keeps_the_experts_expected_soonest(policy, traces):
    predictor = policy.predictor
    predictor.reset()
    it = next(iter(decode_stream(traces[1])))
    predictor.begin_iteration(it.ctx)
    predictor.observe(it.events[0])
    retention = predictor.retention()  # [L, E]
    eviction = policy.make_eviction("device")
    keys = [ExpertKey(layer, e) for layer in range(5) for e in range(8)]
    for key in keys:
        eviction.on_insert(key)
    victim = eviction.victim(keys)
    assert retention[victim] == retention.min()
    # an expert of the next layer the model is sure of is kept over one just used by layer 0
    best_next = int(np.argmax(predictor.state._iteration_table()[1]))
    just_used = int(it.events[0].expert_ids[0, 0])
    if predictor.state._iteration_table()[1, best_next] > 0.5:
        assert retention[1, best_next] > retention[0, just_used]


def test_save_and_load_give_the_same_scores(policy, traces, tmp_path):
    policy.save(tmp_path / "default")
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "default")
    test = traces[1]
    for layer in (0, 3):
        np.testing.assert_allclose(loaded.predictor.score_rows(test, layer, 2), policy.predictor.score_rows(test, layer, 2))


def test_a_loaded_policy_plans_with_its_saved_settings(traces, tmp_path):
    eager = dataclasses.replace(SMALL, min_prefetch_probability=0.3)
    fitted(traces[0], eager, TrainConfig(num_epochs=1, batch_size=64)).save(tmp_path / "eager")
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "eager")
    moving = CacheView(frozenset(), frozenset({ExpertKey(4, 0)}), capacity=4, layer_now=0, num_layers=5)
    requested = [r.key for r in loaded.planner.plan([Prediction(2, 1, 0.4), Prediction(2, 3, 0.2)], moving)]
    assert requested == [ExpertKey(2, 1)]  # 0.4 clears the saved 0.3, not the class default 0.5


def test_works_without_token_strings_and_with_gate_probs(traces):
    train, test = traces
    bare = dataclasses.replace(train, tokens=None, token_ids=None)
    policy = fitted(bare, train=TrainConfig(num_epochs=1, batch_size=64))
    assert policy.predictor.key_kind == ""
    assert evaluate_predictor(policy.predictor, test, 1).hits.sum() > 0
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(8), size=(train.num_tokens, 5)).astype(np.float16)
    gated = fitted(dataclasses.replace(train, gate_probs=probs), train=TrainConfig(num_epochs=1, batch_size=64))
    assert gated.predictor.weights.uses_gate
    run_in_cache(gated, test)


def run_in_cache(policy, trace, slots=10):
    """Drives the policy's predictor and eviction over a small cache; the hit rate."""
    eviction = policy.make_eviction("device")
    cache, hits, accesses = ExpertCache(slots, eviction), 0, 0
    policy.predictor.reset()
    for it in decode_stream(trace):
        policy.predictor.begin_iteration(it.ctx)
        for event in it.events:
            policy.predictor.observe(event)
            for e in event.expert_ids[0].tolist():
                key = ExpertKey(event.layer, e)
                hits += cache.access(key) is not None
                accesses += 1
                if key not in cache:
                    cache.admit(key)
            policy.predictor.predict(event.layer, 2)
        for seq in it.finished:
            policy.predictor.end_sequence(seq)
    return hits / accesses


def test_eviction_beats_lru_on_a_small_cache(policy, traces):
    lru = POLICIES.create("lru", TOPOLOGY)
    assert run_in_cache(policy, traces[1]) > run_in_cache(lru, traces[1])


def _with_revealing_hidden(trace, dim=16):
    """Router inputs whose layer-l row encodes the experts of layer l + 1 (plus noise)."""
    rng = np.random.default_rng(3)
    hot = np.zeros((trace.num_tokens, 5, 8), dtype=np.float32)
    np.put_along_axis(hot, trace.experts.astype(np.int64), 1.0, axis=2)
    nxt = np.concatenate([hot[:, 1:], np.zeros_like(hot[:, :1])], axis=1)  # [N, L, E]
    hidden = np.concatenate([nxt, rng.standard_normal((trace.num_tokens, 5, dim - 8))], axis=2)
    return dataclasses.replace(trace, hidden=hidden.astype(np.float16))


def test_router_inputs_are_used_when_the_trace_has_them(traces, tmp_path):
    train, test = (_with_revealing_hidden(t) for t in traces)
    with_hidden, without = fitted(train), fitted(dataclasses.replace(train, hidden=None))
    assert with_hidden.predictor.needs_hidden and not without.predictor.needs_hidden
    f1 = lambda p: evaluate_predictor(p.predictor, test, 1).f1()  # noqa: E731
    assert f1(with_hidden) > f1(without) + 0.05
    fast = evaluate_predictor(with_hidden.predictor, test, 1)
    with_hidden.predictor.reset()
    slow = evaluate_predictor(OnlineOnly(with_hidden.predictor), test, 1)
    assert (fast.predicted == slow.predicted).all() and np.abs(fast.hits - slow.hits).sum() <= 0.01 * fast.hits.sum()
    with_hidden.save(tmp_path / "d")
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "d")
    assert loaded.predictor.needs_hidden


def test_router_input_weights_per_distance_and_the_older_single_set_load(traces):
    policy = fitted(_with_revealing_hidden(traces[0]))
    arrays = policy.predictor.weights.arrays()
    assert arrays["hidden_out"].shape[:2] == (5, 3)
    older = RoutingWeights(arrays | {"hidden_out": arrays["hidden_out"][:, 0]})  # [L, H2, E], one set for all distances
    rng, hidden = np.random.default_rng(0), policy.predictor.weights.hidden_dim
    args = (rng.standard_normal((2, hidden)).astype(np.float32), np.array([3]), np.array([1]),
            np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 8), np.float32), rng.random((2, hidden)).astype(np.float32))
    np.testing.assert_allclose(older.logits(*args), policy.predictor.weights.logits(*args), rtol=1e-5)
    far = args[:2] + (np.array([3]),) + args[3:]
    assert not np.allclose(older.logits(*far), policy.predictor.weights.logits(*far))


def test_members_learn_apart_and_run_as_one_wider_network(policy, traces):
    weights = policy.predictor.weights
    assert SMALL.num_members > 1
    assert (weights.num_members, weights.hidden_dim) == (SMALL.num_members, SMALL.num_members * SMALL.hidden_dim)
    first, second = weights.prefix[..., : SMALL.hidden_dim], weights.prefix[..., SMALL.hidden_dim : 2 * SMALL.hidden_dim]
    assert not np.allclose(first, second)
    single = fitted(traces[0], config=dataclasses.replace(SMALL, num_members=1)).predictor.weights
    assert (single.num_members, single.hidden_dim) == (1, SMALL.hidden_dim)


@pytest.mark.parametrize("min_steps, epochs", [(0, 1), (20, 3), (10_000, 8)])
def test_small_traces_train_for_more_epochs_up_to_a_cap(traces, min_steps, epochs):
    train = traces[0]  # 420 tokens: 7 batches of 64
    policy = fitted(train, config=dataclasses.replace(SMALL, min_train_steps=min_steps), train=TrainConfig(num_epochs=1, batch_size=64))
    assert train.num_tokens == 420 and len(policy.predictor.losses) == epochs


def _private_maps_trace(num_sequences=40, tokens=24, seed=5):
    """Each sequence routes layer l to its own fixed permutation of layer l-1's experts, so only the
    sequence's earlier tokens reveal where a token goes next."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_sequences):
        perm = rng.permutation(8)
        for _ in range(tokens):
            path = [rng.choice(8, 2, replace=False)]
            for _ in range(4):
                path.append(perm[path[-1]])
            rows.append(np.stack(path))
    n = len(rows)
    return dataclasses.replace(
        synthetic_trace(TOPOLOGY, num_sequences=num_sequences, tokens_per_sequence=tokens, seed=1),
        experts=np.stack(rows).astype(np.int16), tokens=None, token_ids=None,
        seq_ids=np.repeat(np.arange(num_sequences), tokens).astype(np.int32),
        positions=np.tile(np.arange(tokens), num_sequences).astype(np.int32), is_prefill=np.ones(n, dtype=bool))


def test_recall_learns_routing_that_only_the_sequence_reveals(tmp_path):
    train, test = _private_maps_trace().split(0.3, seed=0)
    with_recall = fitted(train)
    without = fitted(train, config=dataclasses.replace(SMALL, use_recall=False))
    assert "recall" in with_recall.predictor.weights.channels and "recall" not in without.predictor.weights.channels
    assert "memory" not in with_recall.predictor.weights.channels  # no token keys, so no token memory
    f1 = lambda p: evaluate_predictor(p.predictor, test, 1).f1()  # noqa: E731
    assert f1(with_recall) > f1(without) + 0.05
    without.save(tmp_path / "plain")  # weights without the recall arrays still load and score
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "plain")
    assert "recall" not in loaded.predictor.weights.channels and f1(loaded) == pytest.approx(f1(without))


def _token_maps_trace(num_sequences=40, tokens=24, vocab=40, seed=6):
    """Each token id routes layer l to its own fixed permutation of layer l-1's experts, so where a
    token goes next depends on which token it is and on how it routed so far, together."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(8) for _ in range(vocab)]
    ids = rng.integers(0, vocab, num_sequences * tokens)
    rows = []
    for token in ids:
        path = [rng.choice(8, 2, replace=False)]
        for _ in range(4):
            path.append(perms[token][path[-1]])
        rows.append(np.stack(path))
    return dataclasses.replace(_private_maps_trace(num_sequences, tokens), experts=np.stack(rows).astype(np.int16),
                               token_ids=ids.astype(np.int32))


def test_token_memory_learns_routing_that_depends_on_the_token_and_its_route_so_far(tmp_path):
    train, test = _token_maps_trace().split(0.3, seed=0)
    with_memory = fitted(train)
    without = fitted(train, config=dataclasses.replace(SMALL, use_memory=False))
    assert "memory" in with_memory.predictor.weights.channels and "memory" not in without.predictor.weights.channels
    f1 = lambda p: evaluate_predictor(p.predictor, test, 1).f1()  # noqa: E731
    assert f1(with_memory) > f1(without) + 0.05
    for policy, name in ((with_memory, "memory"), (without, "plain")):  # the memory travels with the weights
        policy.save(tmp_path / name)  # and weights saved without one still load
        loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / name)
        assert ("memory" in loaded.predictor.weights.channels) == (name == "memory")
        assert f1(loaded) == pytest.approx(f1(policy))


def _repeated_routes_trace(num_sequences=40, tokens=24, vocab=6, seed=7):
    """Within a sequence each token id keeps one private route through all layers, so a token's
    earlier occurrences in its sequence tell where it goes, even before its first layer routes."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, num_sequences * tokens)
    routes = [[np.stack([rng.choice(8, 2, replace=False) for _ in range(5)]) for _ in range(vocab)]
              for _ in range(num_sequences)]
    rows = [routes[i // tokens][token] for i, token in enumerate(ids)]
    return dataclasses.replace(_private_maps_trace(num_sequences, tokens), experts=np.stack(rows).astype(np.int16),
                               token_ids=ids.astype(np.int32))


def test_repeat_channel_recalls_the_tokens_own_earlier_route():
    train, test = _repeated_routes_trace().split(0.3, seed=0)
    with_repeat = fitted(train)
    without = fitted(train, config=dataclasses.replace(SMALL, use_repeat=False))
    assert "repeat" in with_repeat.predictor.weights.channels and "repeat" not in without.predictor.weights.channels
    with_counts, without_counts = (evaluate_predictor(p.predictor, test, 1) for p in (with_repeat, without))
    assert with_counts.f1(layer=0) > without_counts.f1(layer=0) + 0.2  # before any layer of the token routes
    assert with_counts.f1() > without_counts.f1() + 0.1


def test_a_prefill_leaves_the_sequence_as_token_by_token_decoding_would(policy, traces):
    test, predictor = traces[1], policy.predictor
    _, start, end = test.sequence_bounds()[0]
    rows = np.arange(start, end)

    def next_token_predictions(chunks):
        predictor.reset()
        for step, chunk in enumerate(chunks):
            it = iteration(test, chunk, step)
            predictor.begin_iteration(it.ctx)
            for event in it.events:
                predictor.observe(event)
        it = iteration(test, rows[8:9], len(chunks))
        predictor.begin_iteration(it.ctx)
        before = predictor.predict(-1, 1)
        predictor.observe(it.events[0])
        return [(p.layer, p.expert, p.tokens_ahead, round(p.score, 6)) for p in before + predictor.predict(0, 1)]

    prefill = next_token_predictions([rows[:8]])  # one iteration of 8 rows of the same sequence
    assert iteration(test, rows[:8], 0).ctx.is_prefill
    assert prefill == next_token_predictions([rows[i:i + 1] for i in range(8)])


class _NoForesight(POLICIES.get("default-lookahead-4")):
    num_tokens = 0


def test_the_lookahead_bound_is_the_default_without_foresight_and_gains_with_it(policy, traces, tmp_path):
    from moestream.sim import SimConfig, simulate
    from tests.sim import tiny

    policy.save(tmp_path / "default")
    test = traces[1]
    config = SimConfig(cache_ratio=0.25, cost=tiny.cost(), horizon_layers=2)
    runs = {}
    makers = {"default": POLICIES.get("default"), "none": _NoForesight, "four": POLICIES.get("default-lookahead-4")}
    for name, make in makers.items():
        bound = make(TOPOLOGY, predictor_dir=tmp_path / "default")
        bound.prepare(test)
        runs[name] = simulate(bound, test, config)["hits"]
    assert runs["none"] == runs["default"]
    assert runs["four"] > runs["default"]
