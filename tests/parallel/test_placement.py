"""Expert placements: each expert owned once, balanced evens load on skewed routing, deterministic, JSON."""

import json

import numpy as np
import pytest

from moestream.errors import MoestreamError
from moestream.parallel.placement import PLACEMENTS, ActivationStats, Placement, make_placement
from moestream.topology import ExpertKey, Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2, expert_bytes=1000)


def skewed_stats(seed: int = 0) -> ActivationStats:
    trace = synthetic_trace(TOPOLOGY, num_sequences=6, tokens_per_sequence=32, seed=seed)
    return ActivationStats.from_routing(trace.experts, TOPOLOGY.num_experts)


def imbalance(placement: Placement, counts: np.ndarray) -> float:
    """Mean over layers of the busiest rank's expected load over the mean rank's."""
    loads = placement.rank_loads(counts)  # [L, R]
    return float((loads.max(axis=1) / loads.mean(axis=1)).mean())


@pytest.mark.parametrize("name", ["round-robin", "balanced"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_expert_is_owned_by_exactly_one_rank(name, world_size):
    placement = make_placement(name, TOPOLOGY, world_size, skewed_stats())
    owned = [key for rank in range(world_size) for key in placement.experts_of(rank)]
    assert sorted(owned) == sorted(TOPOLOGY.keys())
    assert placement.mapping() == {key: placement.rank_of(key) for key in TOPOLOGY.keys()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_holds_equal_expert_counts(world_size):
    placement = make_placement("balanced", TOPOLOGY, world_size, skewed_stats())
    sizes = [len(placement.experts_of(rank)) for rank in range(world_size)]
    assert sizes == [TOPOLOGY.total_experts // world_size] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_balanced_evens_expected_load_better_than_round_robin(world_size):
    stats = skewed_stats()
    rr = make_placement("round-robin", TOPOLOGY, world_size)
    balanced = make_placement("balanced", TOPOLOGY, world_size, stats)
    assert imbalance(balanced, stats.counts) < imbalance(rr, stats.counts)


def test_balanced_spreads_coactivated_experts():
    topology = Topology(moe_layer_ids=(1,), num_experts=4, top_k=2, expert_bytes=1)
    experts = np.array([[[0, 2]], [[0, 2]], [[1, 3]], [[1, 3]]], dtype=np.int16)  # [N, L, K]
    stats = ActivationStats.from_routing(experts, 4)
    counts_only = make_placement("balanced", topology, 2, ActivationStats(stats.counts))
    placement = make_placement("balanced", topology, 2, stats)
    assert counts_only.owners[0][0] == counts_only.owners[0][2]  # equal counts alone pair them
    assert placement.owners[0][0] != placement.owners[0][2]
    assert placement.owners[0][1] != placement.owners[0][3]


def test_round_robin_cycles_through_ranks():
    placement = make_placement("round-robin", TOPOLOGY, 3)
    assert [placement.rank_of(ExpertKey(2, e)) for e in range(5)] == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("name", PLACEMENTS.names())
def test_placement_is_deterministic(name):
    first = make_placement(name, TOPOLOGY, 4, skewed_stats())
    assert make_placement(name, TOPOLOGY, 4, skewed_stats()) == first


def test_placement_round_trips_through_json(tmp_path):
    placement = make_placement("balanced", TOPOLOGY, 4, skewed_stats())
    placement.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["world_size"] == 4
    loaded = Placement.load(tmp_path / "plan.json")
    assert loaded == placement and loaded.fits(TOPOLOGY)


def test_balanced_without_stats_is_refused():
    with pytest.raises(MoestreamError, match="balanced"):
        make_placement("balanced", TOPOLOGY, 2)


def test_unknown_placement_is_refused():
    with pytest.raises(MoestreamError, match="round-robin"):
        make_placement("striped", TOPOLOGY, 2)


def test_malformed_placement_file_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text('{"name": "x", "world_size": 2, "owners": [[0, 5]]}')
    with pytest.raises(MoestreamError, match="ranks must lie"):
        Placement.load(tmp_path / "plan.json")
