"""MoE-Infinity: EAM counting, the EAM distance, the EAMC, Algorithms 1 and 2, and rebuilds."""

from dataclasses import replace

import numpy as np
import pytest

from moestream.contracts import CacheView
from moestream.events import IterationContext, RoutingEvent
from moestream.policies import POLICIES
from moestream.policies.designs.moe_infinity.policy import (
    MoEInfinityConfig,
    MoEInfinityEviction,
    MoEInfinityPlanner,
    MoEInfinityPredictor,
    build_collection,
    sequence_eams,
    unit_rows,
)
from moestream.topology import ExpertKey, Topology
from moestream.trace.schema import Trace

TOPO = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=4, top_k=1, expert_bytes=1)
EPS = 1e-6

# token routes [token][layer] -> expert, top-1
A = [[0, 1, 2, 3], [0, 1, 2, 3]]
B = [[0, 2, 0, 1], [1, 2, 0, 1]]


def make_trace(sequences, topology=TOPO) -> Trace:
    rows = [token for seq in sequences for token in seq]
    experts = np.array(rows, dtype=np.int16).reshape(len(rows), topology.num_layers, -1)
    lengths = [len(seq) for seq in sequences]
    return Trace(
        topology=topology,
        experts=experts,
        seq_ids=np.repeat(np.arange(len(sequences)), lengths).astype(np.int32),
        positions=np.concatenate([np.arange(n) for n in lengths]).astype(np.int32),
        is_prefill=np.zeros(len(rows), dtype=bool),
    )


def ctx(seqs, step=0):
    seqs = np.asarray(seqs)
    return IterationContext(step=step, seq_ids=seqs, positions=np.zeros(len(seqs), int), is_prefill=False)


def event(layer, experts, seqs):
    seqs = np.asarray(seqs)
    expert_ids = np.asarray(experts, dtype=np.int64).reshape(len(seqs), -1)
    return RoutingEvent(layer=layer, expert_ids=expert_ids, seq_ids=seqs, positions=np.zeros(len(seqs), int))


def serve(predictor, routes, seq, horizon=4):
    """Decode one token per iteration, predicting before the first layer and after each one."""
    for token in routes:
        predictor.begin_iteration(ctx([seq]))
        predictor.predict(-1, horizon)
        for layer, expert in enumerate(token):
            predictor.observe(event(layer, [expert], [seq]))
            predictor.predict(layer, horizon)
    predictor.end_sequence(seq)


def fitted(sequences, **config) -> MoEInfinityPredictor:
    predictor = MoEInfinityPredictor(TOPO, replace(MoEInfinityConfig(), **config))
    predictor.fit(make_trace(sequences))
    return predictor


def by_layer(predictions):
    return {(p.layer, p.expert): p.score for p in predictions}


def test_sequence_eams_count_tokens_per_layer_and_expert():
    eams = sequence_eams(make_trace([[[0, 1, 2, 3], [0, 1, 2, 2]], [[3, 3, 3, 3]]]))
    assert eams.shape == (2, 4, 4)
    assert eams[0].tolist() == [[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 1, 1]]
    assert eams[1].tolist() == [[0, 0, 0, 1]] * 4


def test_online_eam_is_kept_per_sequence_in_a_batch():
    topology = replace(TOPO, top_k=2)
    predictor = MoEInfinityPredictor(topology)
    predictor.begin_iteration(ctx([5, 9]))
    predictor.observe(event(0, [[0, 1], [1, 3]], [5, 9]))
    predictor.observe(event(0, [[0, 2]], [5]))
    assert predictor.eam(5)[0].tolist() == [2, 1, 1, 0]
    assert predictor.eam(9)[0].tolist() == [0, 1, 0, 1]
    assert not predictor.eam(5)[1:].any()


def test_squared_euclidean_of_unit_rows_is_proportional_to_the_distance():
    rng = np.random.default_rng(0)
    m1, m2 = rng.integers(1, 9, size=(2, 4, 6)).astype(float)
    squared = ((unit_rows(m1) - unit_rows(m2)) ** 2).sum()
    distance = 1.0 - (unit_rows(m1) * unit_rows(m2)).sum(axis=-1).mean()  # 1 - mean_l cos(M1[l], M2[l])
    assert squared == pytest.approx(2 * 4 * distance, rel=1e-5)


def clustered_eams(rng, num_groups=3, per_group=6):
    prototypes = rng.dirichlet(np.full(4, 0.2), size=(num_groups, 4)) * 40  # [G, L, E]
    noise = rng.poisson(1.0, size=(num_groups, per_group, 4, 4))
    eams = np.round(prototypes[:, None] + noise).reshape(-1, 4, 4)  # token counts
    return eams, np.repeat(np.arange(num_groups), per_group)


def test_eamc_keeps_the_member_nearest_each_centroid():
    eams, groups = clustered_eams(np.random.default_rng(1))
    kept = build_collection(eams, capacity=3, seed=0)
    assert len(kept) == 3
    points = unit_rows(eams).reshape(len(eams), -1)
    expected = []
    for group in range(3):
        members = np.flatnonzero(groups == group)
        spread = ((points[members] - points[members].mean(axis=0)) ** 2).sum(axis=1)
        expected.append(members[np.argmin(spread)])
    assert sorted(map(tuple, kept.reshape(3, -1))) == sorted(map(tuple, eams[expected].reshape(3, -1)))


@pytest.mark.parametrize("capacity", [1, 2, 5, 50])
def test_eamc_size_never_exceeds_capacity(capacity):
    eams, _ = clustered_eams(np.random.default_rng(2))
    kept = build_collection(eams, capacity=capacity, seed=0)
    assert len(kept) == min(capacity, len(eams))
    assert all(any(np.array_equal(k, e) for e in eams) for k in kept)


def test_algorithm_1_priorities_on_a_hand_made_case():
    # one EAM: layer rows [4,0,0,0], [1,3,0,0], [0,0,2,2], [1,1,1,1]
    predictor = fitted([[[0, 0, 2, 0], [0, 1, 2, 1], [0, 1, 3, 2], [0, 1, 3, 3]]], eps=EPS)
    predictor.begin_iteration(ctx([7]))
    predictor.observe(event(0, [0], [7]))
    predictions = predictor.predict(0, 4)
    assert by_layer(predictions) == pytest.approx(
        {(1, 0): 0.25, (1, 1): 0.75, (2, 2): 0.5, (2, 3): 0.5, (3, 0): 0.25, (3, 1): 0.25, (3, 2): 0.25, (3, 3): 0.25}
    )
    view = CacheView(frozenset({ExpertKey(1, 0)}), frozenset({ExpertKey(3, 3)}), capacity=5, layer_now=0, num_layers=4)
    plan = MoEInfinityPlanner(EPS).plan(predictions, view)
    expected = {
        (1, 1): (0.75 + EPS) * 0.75,
        (2, 2): (0.5 + EPS) * 0.5,
        (2, 3): (0.5 + EPS) * 0.5,
        (3, 0): (0.25 + EPS) * 0.25,
        (3, 1): (0.25 + EPS) * 0.25,
        (3, 2): (0.25 + EPS) * 0.25,
    }
    assert len(plan) == 5 and plan[0].key == (1, 1)
    assert [r.priority for r in plan] == sorted((r.priority for r in plan), reverse=True)
    for request in plan:
        assert request.priority == pytest.approx(expected[tuple(request.key)])


def test_horizon_limits_the_layers_predicted():
    predictor = fitted([A])
    predictor.begin_iteration(ctx([1]))
    predictor.observe(event(0, [0], [1]))
    assert {p.layer for p in predictor.predict(0, 1)} == {1}
    assert predictor.predict(3, 4) == []


def test_unseen_experts_are_submitted_only_when_asked():
    predictor = fitted([A], prefetch_unseen=True)
    predictor.begin_iteration(ctx([1]))
    predictor.observe(event(0, [0], [1]))
    scores = by_layer(predictor.predict(0, 1))
    assert len(scores) == 4 and scores[(1, 1)] == 1.0 and scores[(1, 0)] == 0.0


@pytest.mark.parametrize("refine, expected_expert", [(True, 0), (False, 2)])
def test_matching_is_refined_at_every_layer_unless_ablated(refine, expected_expert):
    predictor = fitted([A, B], refine=refine)
    predictor.begin_iteration(ctx([3]))
    predictor.observe(event(0, [0], [3]))  # layer 0 resembles A (4,0,0,0) more than B (1,1,0,0)
    assert max(by_layer(predictor.predict(0, 1)).items(), key=lambda kv: kv[1])[0] == (1, 1)
    predictor.observe(event(1, [2], [3]))  # layer 1 is B's
    scores = by_layer(predictor.predict(1, 1))
    assert max(scores.items(), key=lambda kv: kv[1])[0] == (2, expected_expert)


def test_batched_prediction_averages_the_matches_of_each_sequence():
    predictor = fitted([A, B])
    predictor.begin_iteration(ctx([1, 2]))
    predictor.observe(event(0, [0, 1], [1, 2]))
    predictor.observe(event(1, [1, 2], [1, 2]))  # sequence 1 follows A, sequence 2 follows B
    assert by_layer(predictor.predict(1, 1)) == pytest.approx({(2, 2): 0.5, (2, 0): 0.5})


def test_algorithm_2_evicts_the_lowest_ratio_times_layer_weight():
    predictor = MoEInfinityPredictor(TOPO)
    eviction = MoEInfinityEviction(predictor, EPS)
    predictor.begin_iteration(ctx([4]))
    predictor.observe(event(0, [0, 0, 1], [4, 4, 4]))  # a prefill: shares 2/3, 1/3 at layer 0
    predictor.observe(event(1, [2, 2, 2], [4, 4, 4]))
    keys = [ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(1, 2), ExpertKey(2, 3), ExpertKey(3, 1)]
    for key in keys:
        eviction.on_insert(key)
    assert [eviction.score_matrix()[key] for key in keys] == pytest.approx(
        [(2 / 3 + EPS), (1 / 3 + EPS), (1 + EPS) * 0.75, EPS * 0.5, EPS * 0.25]
    )
    assert eviction.victim(keys) == (3, 1)
    assert eviction.victim(keys[:4]) == (2, 3)
    assert eviction.victim(keys[:3]) == (0, 1)


def test_algorithm_2_ties_go_to_the_least_recently_used():
    eviction = MoEInfinityEviction(MoEInfinityPredictor(TOPO), EPS)
    for key in [ExpertKey(3, 2), ExpertKey(3, 0), ExpertKey(3, 1)]:
        eviction.on_insert(key)
    eviction.on_access(ExpertKey(3, 2))
    assert eviction.victim([ExpertKey(3, 2), ExpertKey(3, 0), ExpertKey(3, 1)]) == (3, 0)


def test_poor_sequences_trigger_a_synchronous_rebuild():
    predictor = fitted([A], rebuild_after_poor=2, poor_accuracy=1.0, rebuild_lag_sequences=0)
    serve(predictor, B, seq=10)
    assert predictor.num_rebuilds == 0
    serve(predictor, B, seq=11)
    assert predictor.num_rebuilds == 1 and predictor.eamc.version == 1
    assert len(predictor.dataset) == 3
    assert any(np.array_equal(eam, sequence_eams(make_trace([B]))[0]) for eam in predictor.eamc.eams)


def test_well_predicted_sequences_do_not_trigger_a_rebuild():
    predictor = fitted([A, B], rebuild_after_poor=1, poor_accuracy=0.5, rebuild_lag_sequences=0)
    for seq in range(3):
        serve(predictor, A, seq=seq)
    assert predictor.num_rebuilds == 0


def test_background_rebuild_installs_after_the_lag_with_the_same_result():
    synchronous = fitted([A], rebuild_after_poor=1, poor_accuracy=1.0, rebuild_lag_sequences=0)
    threaded = fitted([A], rebuild_after_poor=1, poor_accuracy=1.0, rebuild_lag_sequences=2)
    serve(synchronous, B, seq=1)
    serve(threaded, B, seq=1)  # triggers the rebuild
    assert threaded.num_rebuilds == 0
    serve(threaded, A, seq=2)
    assert threaded.num_rebuilds == 0
    serve(threaded, A, seq=3)
    assert threaded.num_rebuilds == 1
    np.testing.assert_array_equal(threaded.eamc.eams, synchronous.eamc.eams)


def test_policies_share_the_predictor_state_with_a_fresh_eviction_per_tier():
    for name in ("moe-infinity", "moe-infinity-norefine"):
        policy = POLICIES.create(name, TOPO)
        device, host = policy.make_eviction("device"), policy.make_eviction("host")
        assert device is not host and device.predictor is host.predictor is policy.predictor
    assert POLICIES.create("moe-infinity-norefine", TOPO).predictor.config.refine is False
