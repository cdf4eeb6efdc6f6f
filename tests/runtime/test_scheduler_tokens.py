"""Token schedulers: fifo keeps arrival order; expertflow puts sequences with close routing paths in
the same batch (balanced: no batch over batch_size) so each batch activates fewer experts."""

import pickle

import numpy as np
import pytest

from moestream.events import IterationContext, RoutingEvent
from moestream.runtime.scheduling.token_scheduler import TOKEN_SCHEDULERS, RoutingPaths
from moestream.topology import Topology

NUM_LAYERS, NUM_EXPERTS = 4, 8


def _paths(families: list[int], seed: int = 0) -> np.ndarray:
    """[N, L * E]: sequence i routes like family families[i] (family f: experts 2f and 2f + 1 at
    every layer), with one expert of one layer swapped at random."""
    rng = np.random.default_rng(seed)
    paths = np.zeros((len(families), NUM_LAYERS, NUM_EXPERTS), bool)
    for row, family in enumerate(families):
        paths[row, :, [2 * family, 2 * family + 1]] = True
        layer = rng.integers(NUM_LAYERS)
        paths[row, layer] = False
        paths[row, layer, rng.choice(NUM_EXPERTS, 2, replace=False)] = True
    return paths.reshape(len(families), -1)


def _activated(paths: np.ndarray, groups: list[list[int]]) -> list[int]:
    return [int(paths[g].any(axis=0).sum()) for g in groups]


def test_fifo_keeps_arrival_order():
    assert TOKEN_SCHEDULERS.create("fifo").group(_paths([0, 1, 2, 3, 0]), 2) == [[0, 1], [2, 3], [4]]


def test_expertflow_groups_sequences_that_route_alike():
    families = [0, 1, 2, 3, 2, 0, 3, 1] * 2  # interleaved: fifo mixes every family in each batch
    paths = _paths(families)
    groups = TOKEN_SCHEDULERS.create("expertflow").group(paths, 4)
    assert sorted(i for g in groups for i in g) == list(range(16)) and all(len(g) <= 4 for g in groups)
    assert all(len({families[i] for i in g}) == 1 for g in groups)
    fifo = TOKEN_SCHEDULERS.create("fifo").group(paths, 4)
    assert sum(_activated(paths, groups)) < sum(_activated(paths, fifo))


@pytest.mark.parametrize("count, batch", [(7, 3), (5, 5), (1, 4), (9, 2)])
def test_expertflow_batches_are_balanced_and_cover_everyone(count, batch):
    paths = _paths([i % 3 for i in range(count)], seed=count)
    groups = TOKEN_SCHEDULERS.create("expertflow").group(paths, batch)
    assert sorted(i for g in groups for i in g) == list(range(count))
    assert len(groups) == -(-count // batch) and all(0 < len(g) <= batch for g in groups)


def test_expertflow_is_deterministic():
    paths = _paths([0, 1, 2, 3] * 3, seed=5)
    scheduler = TOKEN_SCHEDULERS.create("expertflow")
    assert scheduler.group(paths, 4) == scheduler.group(paths.copy(), 4)


def test_routing_paths_keep_each_sequence_s_newest_token_and_count_activated_experts():
    paths = RoutingPaths(Topology(moe_layer_ids=(0, 1), num_experts=4, top_k=1, expert_bytes=1))
    paths.begin_iteration(IterationContext(0, np.array([7, 7, 8]), np.array([0, 1, 0]), True))
    paths.observe(RoutingEvent(0, np.array([[0], [1], [2]]), np.array([7, 7, 8]), np.array([0, 1, 0])))
    assert paths.path(7).reshape(2, 4)[0].tolist() == [False, True, False, False]  # the last prompt token's
    paths.begin_iteration(IterationContext(1, np.array([7, 8]), np.array([2, 1]), False))
    paths.observe(RoutingEvent(0, np.array([[3], [3]]), np.array([7, 8]), np.array([2, 1])))
    paths.observe(RoutingEvent(1, np.array([[0], [2]]), np.array([7, 8]), np.array([2, 1])))
    assert paths.mean_activated() == 3  # (0, 3), (1, 0), (1, 2): prefill iterations are not counted
    paths.end_sequence(7)
    assert not paths.path(7).any() and paths.path(8).reshape(2, 4)[1].tolist() == [False, False, True, False]


def test_routing_paths_count_decodes_without_a_record_per_iteration():
    """A server's routing-path observer lives as long as the server: its size must not grow with it."""
    paths = RoutingPaths(Topology(moe_layer_ids=(0, 1), num_experts=4, top_k=1, expert_bytes=1))

    def decode(step: int) -> None:  # even steps activate one expert, odd steps two
        paths.begin_iteration(IterationContext(step, np.array([7]), np.array([step]), False))
        paths.observe(RoutingEvent(0, np.array([[0]]), np.array([7]), np.array([step])))
        if step % 2:
            paths.observe(RoutingEvent(1, np.array([[1]]), np.array([7]), np.array([step])))

    for step in range(10):
        decode(step)
    assert paths.mean_activated() == 1.5
    size = len(pickle.dumps(paths))
    for step in range(10, 2010):
        decode(step)
    assert paths.mean_activated() == 1.5
    assert len(pickle.dumps(paths)) < size + 64  # 2000 more iterations, a few bytes more for the counts
