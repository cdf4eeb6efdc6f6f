"""fMoE: expert maps, the deduplicating map store, semantic/trajectory matching, delta selection,
p x freq eviction."""

from dataclasses import replace

import numpy as np
import pytest

from moestream.bench.sim.replay import decode_stream
from moestream.events import IterationContext, RoutingEvent
from moestream.policies import POLICIES
from moestream.policies.designs.fmoe.policy import FMoEConfig, FMoEEviction, FMoEPredictor, MapStore, select_experts
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace

TOPO = Topology(moe_layer_ids=(1, 2, 3, 4, 5), num_experts=4, top_k=1, expert_bytes=1)


def make_trace(routes, topology=TOPO, embeddings=None, gate_probs=None) -> Trace:
    """routes [token][layer] -> expert ids (int, or a list of top-k ids); one sequence per token."""
    experts = np.array(routes, dtype=np.int16).reshape(len(routes), topology.num_layers, -1)
    n = len(routes)
    return Trace(
        topology=topology,
        experts=experts,
        seq_ids=np.arange(n, dtype=np.int32),
        positions=np.zeros(n, dtype=np.int32),
        is_prefill=np.zeros(n, dtype=bool),
        embeddings=None if embeddings is None else np.asarray(embeddings, dtype=np.float16),
        gate_probs=gate_probs,
    )


def ctx(seqs, embeddings=None):
    seqs = np.asarray(seqs)
    emb = None if embeddings is None else np.asarray(embeddings, dtype=np.float32)
    return IterationContext(step=0, seq_ids=seqs, positions=np.zeros(len(seqs), int), is_prefill=False,
                            embeddings=emb)


def event(layer, experts, seqs):
    seqs = np.asarray(seqs)
    expert_ids = np.asarray(experts, dtype=np.int64).reshape(len(seqs), -1)
    return RoutingEvent(layer=layer, expert_ids=expert_ids, seq_ids=seqs, positions=np.zeros(len(seqs), int))


def predictor(routes, embeddings=None, **config) -> FMoEPredictor:
    p = FMoEPredictor(TOPO, replace(FMoEConfig(), **config))
    p.fit(make_trace(routes, embeddings=embeddings))
    return p


def chosen(predictions):
    return {(p.layer, p.expert) for p in predictions}


def test_top_k_traces_give_one_hot_maps_and_say_so():
    topology = replace(TOPO, top_k=2)
    p = FMoEPredictor(topology)
    p.fit(make_trace([[[0, 1], [2, 3], [0, 2], [1, 3], [0, 3]]], topology=topology))
    assert p.uses_one_hot_maps is True
    assert p.store.size == 1
    np.testing.assert_allclose(p.store.maps[0, 0], [0.5, 0.5, 0, 0])
    np.testing.assert_allclose(p.store.maps[0].sum(axis=1), 1.0)


def test_gate_probabilities_are_the_maps_when_given():
    probs = np.random.default_rng(0).dirichlet(np.ones(4), size=(2, 5)).astype(np.float16)  # [N, L, E]
    p = FMoEPredictor(TOPO)
    p.fit(make_trace([[0] * 5, [1] * 5], gate_probs=probs))
    assert p.uses_one_hot_maps is False
    np.testing.assert_allclose(p.store.maps[:2], probs.astype(np.float32))


def one_hot(layers):
    m = np.zeros((5, 4), dtype=np.float32)
    m[np.arange(5), layers] = 1.0
    return m


def test_full_store_replaces_the_most_redundant_map():
    store = MapStore(num_layers=5, num_experts=4, capacity=3, prefetch_distance=2)
    maps = np.stack([one_hot([0] * 5), one_hot([1] * 5), one_hot([2] * 5), one_hot([1, 1, 1, 1, 3])])
    store.add_many(maps, None)
    assert store.size == 3
    np.testing.assert_array_equal(store.maps, maps[[0, 3, 2]])  # the new map shares 4 of 5 layers with slot 1


@pytest.mark.parametrize("distance, slot", [(4, 1), (1, 0)])
def test_redundancy_weighs_semantic_by_d_over_l_and_trajectory_by_the_rest(distance, slot):
    store = MapStore(num_layers=5, num_experts=4, capacity=2, prefetch_distance=distance)
    embeddings = np.array([[1, 0], [0, 1], [0, 1]], dtype=np.float32)
    maps = np.stack([one_hot([0] * 5), one_hot([1] * 5), one_hot([0, 0, 0, 0, 1])])
    store.add_many(maps, embeddings)
    # the new map: trajectory cosine 0.8 with slot 0 and 0.2 with slot 1; semantic 0 and 1
    expected = {0: maps[2], 1: maps[1]} if slot == 0 else {0: maps[0], 1: maps[2]}
    for index, stored in expected.items():
        np.testing.assert_array_equal(store.maps[index], stored)


def test_adding_maps_in_bulk_equals_adding_them_online():
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(4), size=(12, 5)).astype(np.float16)  # [N, L, E]
    trace = make_trace([[0] * 5] * 12, gate_probs=probs)
    bulk, online = (FMoEPredictor(TOPO, replace(FMoEConfig(), store_capacity=5)) for _ in range(2))
    bulk.fit(trace)
    for it in decode_stream(trace):
        online.begin_iteration(it.ctx)
        for e in it.events:
            online.observe(e)
            online.predict(e.layer, 3)
    np.testing.assert_allclose(online.store.maps, bulk.store.maps, atol=1e-6)


def test_semantic_matching_serves_layers_below_d_and_trajectory_the_rest():
    p = predictor([[0] * 5, [1] * 5], embeddings=[[1, 0], [0, 1]], prefetch_distance=2)
    p.begin_iteration(ctx([9], embeddings=[[2, 0]]))  # semantically map 0, routed like map 1
    assert p.semantic_available
    assert chosen(p.predict(-1, 5)) == {(0, 0), (1, 0)}
    p.observe(event(0, [1], [9]))
    assert chosen(p.predict(0, 5)) == {(1, 0), (2, 1)}
    p.observe(event(1, [1], [9]))
    assert chosen(p.predict(1, 5)) == {(2, 1), (3, 1)}


def test_without_embeddings_every_layer_uses_trajectory_matching(caplog):
    p = predictor([[0] * 5, [1] * 5], embeddings=[[1, 0], [0, 1]], prefetch_distance=2)
    p.begin_iteration(ctx([9]))
    assert not p.semantic_available
    assert "semantic matching is unavailable" in caplog.text
    assert p.predict(-1, 5) == []
    p.observe(event(0, [1], [9]))
    assert chosen(p.predict(0, 5)) == {(1, 1), (2, 1)}


def test_trajectory_ablation_ignores_embeddings():
    policy = POLICIES.create("fmoe-trajectory", TOPO)
    assert not policy.predictor.needs_embeddings and POLICIES.create("fmoe", TOPO).predictor.needs_embeddings
    policy.fit(make_trace([[0] * 5, [1] * 5], embeddings=[[1, 0], [0, 1]]))
    p = policy.predictor
    p.begin_iteration(ctx([9], embeddings=[[1, 0]]))
    assert p.predict(-1, 3) == []
    p.observe(event(0, [1], [9]))
    assert chosen(p.predict(0, 1)) == {(1, 1)}


def test_batched_iterations_match_each_sequence_and_store_each_map():
    p = predictor([[0] * 5, [1] * 5], prefetch_distance=2)
    p.begin_iteration(ctx([4, 6]))
    p.observe(event(0, [0, 1], [4, 6]))
    assert chosen(p.predict(0, 2)) == {(1, 0), (2, 0), (1, 1), (2, 1)}
    for layer in range(1, 5):
        p.observe(event(layer, [0, 1], [4, 6]))
    assert p.store.size == 4


def test_a_prefill_map_averages_its_tokens():
    p = FMoEPredictor(TOPO)
    p.begin_iteration(ctx([3, 3, 3, 3]))
    for layer in range(5):
        p.observe(event(layer, [0, 0, 1, 2], [3, 3, 3, 3]))
    np.testing.assert_allclose(p.store.maps[0, 0], [0.5, 0.25, 0.25, 0])


@pytest.mark.parametrize(
    "similarity, expected",
    [(0.9, [0]), (0.3, [0, 1]), (0.15, [0, 1, 2]), (1.5, [0]), (-1.0, [0, 1, 2, 3])],
)
def test_delta_selection_reaches_one_minus_similarity(similarity, expected):
    probs = np.array([[0.5, 0.3, 0.12, 0.08]])
    mask = select_experts(probs, np.array([similarity]), top_k=1, by_delta=True)
    assert np.flatnonzero(mask[0]).tolist() == expected


def test_delta_selection_is_minimal_with_at_least_k_and_fixed_k_without_delta():
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.full(16, 0.5), size=200)  # [S, E]
    similarity = rng.uniform(-0.2, 1.2, size=200)
    mask = select_experts(probs, similarity, top_k=3, by_delta=True)
    delta = np.clip(1 - similarity, 0, 1)
    for row, keep, need in zip(probs, mask, delta):
        assert keep.sum() >= 3 and row[keep].sum() >= need - 1e-9
        if keep.sum() > 3:
            assert row[keep].sum() - row[keep].min() < need
    assert (select_experts(probs, similarity, top_k=3, by_delta=False).sum(axis=1) == 3).all()


def test_eviction_takes_the_smallest_probability_times_frequency():
    p = FMoEPredictor(TOPO)
    eviction = FMoEEviction(p)
    p.current_probs = np.full((5, 4), 0.1, dtype=np.float32)
    p.current_probs[0, 0], p.current_probs[0, 1] = 0.9, 0.05
    eviction.observe(event(0, [0, 1, 1, 1, 2], [1, 2, 3, 4, 5]))  # freq 1, 3, 1 at layer 0
    keys = [ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(0, 2)]
    for key in keys:
        eviction.on_insert(key)
    assert [eviction.score_matrix()[key] for key in keys] == pytest.approx([0.9, 0.15, 0.1])
    assert eviction.victim(keys) == (0, 2)
    eviction.on_access(ExpertKey(0, 3))
    eviction.on_insert(ExpertKey(1, 0))
    assert eviction.victim([ExpertKey(1, 0), ExpertKey(0, 3)]) == (0, 3)  # both 0: least recent goes


def test_ablations_differ_only_in_their_configuration():
    full, semantic, trajectory = (POLICIES.get(n).config for n in ("fmoe", "fmoe-semantic", "fmoe-trajectory"))
    assert full.semantic and full.delta_selection
    assert semantic.semantic and not semantic.delta_selection
    assert not trajectory.semantic and not trajectory.delta_selection
    assert all(POLICIES.get(n).predicts_in_background for n in ("fmoe", "fmoe-semantic", "fmoe-trajectory"))


def test_on_the_deepseek_trace_maps_are_one_hot_and_semantic_matching_is_off(deepseek_dev_path):
    from moestream.trace.format import load_trace

    trace = load_trace(deepseek_dev_path)
    train, test = trace.split(0.2, seed=0)
    policy = POLICIES.create("fmoe", trace.topology)
    policy.fit(train.select(train.sequence_ids()[:30]))
    p = policy.predictor
    assert p.uses_one_hot_maps and p.store.size == p.store.capacity  # ~2,800 tokens for 1,000 slots
    it = next(decode_stream(test))
    p.begin_iteration(it.ctx)
    assert not p.semantic_available and p.predict(-1, 3) == []
    p.observe(it.events[0])
    assert len(chosen(p.predict(0, 1))) == trace.topology.top_k  # one-hot maps: exactly the top-k
