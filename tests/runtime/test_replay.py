"""Routing replay: the engine follows a recorded trace's routing, row by row, and says so."""

import dataclasses

import numpy as np
import pytest
import torch

from moestream.checkpoint.index import build_index
from moestream.events import IterationContext
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.replay import ReplayError, RoutingReplay
from moestream.topology import Topology
from moestream.trace.format import save_trace
from moestream.trace.recorder import TraceRecorder
from tests.synthetic import synthetic_trace

PROMPT = "The cat sat on the mat and"


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("deepseek_v2", num_layers=4, num_experts=8, top_k=2)


@pytest.fixture(scope="module")
def trace_file(model, tmp_path_factory):
    """A synthetic trace of the model's routing shape, with other expert sizes (as DeepSeek's real one)."""
    topology = dataclasses.replace(build_index(model).topology, expert_bytes=12345)
    path = tmp_path_factory.mktemp("replay") / "trace.npz"
    save_trace(synthetic_trace(topology, num_sequences=2, tokens_per_sequence=6, seed=3), path)
    return path


def _ctx(num_tokens: int) -> IterationContext:
    return IterationContext(0, np.zeros(num_tokens, np.int64), np.arange(num_tokens), num_tokens > 1)


def _generate(model, trace_file, recorder=None, **config):
    settings = dict(expert_budget="0.5", direct_io=False, replay_routing=str(trace_file)) | config
    with Engine(model, EngineConfig(**settings), observers=[recorder] if recorder else ()) as engine:
        result = engine.generate([PROMPT], max_new_tokens=4)
        return result, engine.replay


def test_the_engine_routes_each_processed_token_as_the_trace_row_it_was_given(model, trace_file):
    from moestream.trace.format import load_trace

    trace = load_trace(trace_file)
    recorder = TraceRecorder(build_index(model).topology)
    result, replay = _generate(model, trace_file, recorder)
    routed = recorder.to_trace().experts  # [N, L, K]: what every layer really ran, per processed token
    fed = np.concatenate(replay.iterations)  # [N] trace rows, in processing order
    assert result.replayed
    assert len(fed) == routed.shape[0] == result.metrics.num_prompt_tokens + 3  # the last token is not run
    assert fed.tolist() == [row % 12 for row in range(len(fed))]  # 12 trace rows, read in order, wrapping
    assert replay.wraps == len(fed) // 12 >= 1
    np.testing.assert_array_equal(np.sort(routed, -1), np.sort(trace.experts[fed], -1))


def test_replay_is_deterministic_and_differs_from_the_router(model, trace_file):
    first, _ = _generate(model, trace_file)
    second, _ = _generate(model, trace_file, policy="lfu")
    with Engine(model, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        own = engine.generate([PROMPT], max_new_tokens=4)
    assert first.token_ids == second.token_ids
    assert not own.replayed
    assert (first.metrics.expert_hits, first.metrics.expert_misses) != (own.metrics.expert_hits,
                                                                        own.metrics.expert_misses)


def test_a_trace_of_another_routing_shape_is_refused(model, tmp_path):
    topology = dataclasses.replace(build_index(model).topology, num_experts=16)
    path = tmp_path / "other.npz"
    save_trace(synthetic_trace(topology, num_sequences=1, tokens_per_sequence=4), path)
    with pytest.raises(ReplayError, match="16 experts"):
        Engine(model, EngineConfig(direct_io=False, replay_routing=str(path)))


def test_rows_run_on_across_iterations_and_wrap():
    topo = Topology((1, 2), num_experts=4, top_k=2, expert_bytes=8)
    replay = RoutingReplay(synthetic_trace(topo, num_sequences=1, tokens_per_sequence=5), topo)
    for num_tokens in (3, 1, 4):
        replay.begin_iteration(_ctx(num_tokens))
    assert [rows.tolist() for rows in replay.iterations] == [[0, 1, 2], [3], [4, 0, 1, 2]]
    assert replay.cursor == 3 and replay.wraps == 1 and replay.rows_used == 8


def test_the_record_of_iterations_is_bounded(monkeypatch):
    monkeypatch.setattr("moestream.runtime.replay.MAX_RECORDED_ITERATIONS", 2)
    topo = Topology((1, 2), num_experts=4, top_k=2, expert_bytes=8)
    replay = RoutingReplay(synthetic_trace(topo, num_sequences=1, tokens_per_sequence=5), topo)
    replay.begin_iteration(_ctx(2))
    assert replay.recorded_all
    for num_tokens in (3, 1):
        replay.begin_iteration(_ctx(num_tokens))
    assert [rows.tolist() for rows in replay.iterations] == [[2, 3, 4], [0]]  # the last two
    assert replay.rows_used == 6 and not replay.recorded_all


def test_a_paused_replay_leaves_the_router_s_routing_and_takes_no_rows():
    topo = Topology((1, 2), num_experts=4, top_k=2, expert_bytes=8)
    replay = RoutingReplay(synthetic_trace(topo, num_sequences=1, tokens_per_sequence=5), topo)
    index, weights = torch.tensor([[3, 2]]), torch.tensor([[0.6, 0.4]])
    with replay.paused():
        replay.begin_iteration(_ctx(1))
        assert replay.route(0, np.array([True]), index, weights) == (index, weights)
    assert replay.cursor == 0 and replay.rows_used == 0 and not replay.iterations
    replay.begin_iteration(_ctx(1))
    assert replay.route(0, np.array([True]), index, weights)[0].tolist() == [replay._experts[0, 0].tolist()]
