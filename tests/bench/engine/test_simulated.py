"""The engine's replayed rows as the simulator replays them: same rows, same iterations, decode figures."""

import numpy as np
import pytest

from moestream.bench.engine.simulated import engine_iterations, oracle_bytes_per_token, replayed, sim_ratio, simulate
from moestream.bench.sim.cost import measured_cost_model
from moestream.policies import POLICIES
from moestream.topology import Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=17_000_000)  # the recorded model
MODEL = Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=1_000_000)  # the replaying model
COST = measured_cost_model(3, decode_ms_per_token=3.0, expert_bytes=1_000_000, expert_read_ms=1.0, source="test")


@pytest.fixture
def run():
    """Two prompts as the engine ran them: prefill of 3 rows then 2 decode rows; prefill of 2, then 3 decode
    rows, the last wrapping to the trace's first row."""
    trace = synthetic_trace(TOPOLOGY, num_sequences=1, tokens_per_sequence=10, seed=2)
    iterations = [[0, 1, 2], [3], [4], [5, 6], [7], [8], [9], [0]]
    prefill = [True, False, False, True, False, False, False, False]
    return trace, replayed(trace, iterations, prefill, MODEL)


def test_the_replayed_rows_keep_their_routing_prompts_and_positions(run):
    trace, sub = run
    assert sub.trace.num_tokens == 11 and sub.trace.topology == MODEL
    np.testing.assert_array_equal(sub.trace.experts[-1], trace.experts[0])  # the wrapped row is a new row
    assert sub.trace.seq_ids.tolist() == [0] * 5 + [1] * 6
    assert sub.trace.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert sub.trace.is_prefill.tolist() == [True] * 3 + [False] * 2 + [True] * 2 + [False] * 4


def test_engine_iterations_have_the_engine_shapes_and_end_each_prompt(run):
    _, sub = run
    its = engine_iterations(sub)
    assert [len(it.rows) for it in its] == sub.sizes
    assert [it.finished for it in its] == [(), (), (0,), (), (), (), (), (1,)]


def test_the_engines_own_tokens_reach_the_simulators_iterations(run):
    trace, _ = run
    iterations = [[0, 1, 2], [3], [4], [5, 6], [7], [8], [9], [0]]
    prefill = [True, False, False, True, False, False, False, False]
    ids = [[10 * i + j for j in range(len(rows))] for i, rows in enumerate(iterations)]
    strings = [[f"t{v}" for v in values] for values in ids]
    sub = replayed(trace, iterations, prefill, MODEL, ids, strings)
    its = engine_iterations(sub)
    assert [it.ctx.token_ids.tolist() for it in its] == ids
    assert [list(it.ctx.tokens) for it in its] == strings
    unmatched = replayed(trace, iterations, prefill, MODEL, ids[:-1], strings[:-1])  # not one per iteration
    assert unmatched.trace.token_ids is None and unmatched.trace.tokens is None


def test_decode_figures_leave_prefill_out_and_grow_with_fewer_slots(run):
    _, sub = run
    its = engine_iterations(sub)
    full = simulate(POLICIES.create("lru", MODEL), sub, its, 1.0, COST)
    tight = simulate(POLICIES.create("lru", MODEL), sub, engine_iterations(sub), sim_ratio(5, MODEL), COST)
    assert full["decode_tokens"] == tight["decode_tokens"] == 6
    assert tight["hit_rate"] < full["hit_rate"] <= 1.0
    assert tight["bytes_per_token"] > full["bytes_per_token"] >= 0
    # on-demand reads in the simulator: every byte moved is waited for, at the calibrated 1 ms per expert
    assert tight["stall_ms_per_token"] == pytest.approx(tight["bytes_per_token"] / 1_000_000 * 1.0)
    assert tight["tpot_ms"] == pytest.approx(3.0 + tight["stall_ms_per_token"])


def test_the_oracle_moves_no_more_than_lru(run):
    _, sub = run
    ratio = sim_ratio(5, MODEL)
    lru = simulate(POLICIES.create("lru", MODEL), sub, engine_iterations(sub), ratio, COST)
    assert 0 < oracle_bytes_per_token(sub, ratio, COST) <= lru["bytes_per_token"]
    assert MODEL.slots_for_ratio(ratio) == 5
