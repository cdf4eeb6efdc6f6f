"""TraceRecorder: the engine's routing events back into a Trace, for every iteration shape."""

import dataclasses

import numpy as np
import pytest

from moestream.bench.sim.replay import batched_decode, decode_stream, prefill
from moestream.errors import TraceError
from moestream.events import IterationContext, RoutingEvent
from moestream.topology import Topology
from moestream.trace.format import load_trace, save_trace
from moestream.trace.recorder import TraceRecorder
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(0, 1, 2), num_experts=6, top_k=2, expert_bytes=10)


@pytest.fixture
def trace():
    base = synthetic_trace(TOPOLOGY, num_sequences=4, tokens_per_sequence=5, seed=2)
    rng = np.random.default_rng(2)
    n = base.num_tokens
    return dataclasses.replace(
        base,
        gate_weights=rng.random((n, 3, 2)).astype(np.float16),
        gate_probs=rng.random((n, 3, 6)).astype(np.float16),
        hidden=rng.standard_normal((n, 3, 4)).astype(np.float16),
    )


def _record(iterations, recorder=None):
    recorder = recorder or TraceRecorder(TOPOLOGY)
    for it in iterations:
        recorder.begin_iteration(it.ctx)
        for event in it.events:
            recorder.observe(event)
        for seq in it.finished:
            recorder.end_sequence(seq)
    return recorder


@pytest.mark.parametrize("replay", [decode_stream, prefill, lambda t: batched_decode(t, 3)])
def test_replayed_events_give_back_the_trace(trace, replay):
    recorded = _record(replay(trace)).to_trace()
    for name in ("experts", "seq_ids", "positions", "token_ids", "gate_weights", "gate_probs", "hidden"):
        np.testing.assert_array_equal(getattr(recorded, name), getattr(trace, name), err_msg=name)
    assert recorded.tokens == trace.tokens and recorded.embeddings is None


def _ctx(step, seq_ids, positions, prefill_flag):
    return IterationContext(step, np.array(seq_ids), np.array(positions), prefill_flag,
                            token_ids=np.array(positions) + 100)


def _events(seq_ids, positions, base):
    n = len(seq_ids)
    return [RoutingEvent(layer, (np.arange(n * 2).reshape(n, 2) + base + layer) % 6, np.array(seq_ids), np.array(positions))
            for layer in range(3)]


def _run(recorder, seq_ids, positions, prefill_flag=False, step=0, base=0):
    recorder.begin_iteration(_ctx(step, seq_ids, positions, prefill_flag))
    for event in _events(seq_ids, positions, base):
        recorder.observe(event)


def test_prefill_then_batched_decode_marks_prefill_rows():
    recorder = TraceRecorder(TOPOLOGY)
    _run(recorder, [5, 5, 5], [0, 1, 2], prefill_flag=True)
    _run(recorder, [8, 8], [0, 1], prefill_flag=True, step=1)
    _run(recorder, [5, 8], [3, 2], step=2)
    recorder.end_sequence(8)
    _run(recorder, [5], [4], step=3)
    trace = recorder.to_trace()
    assert trace.seq_ids.tolist() == [5, 5, 5, 5, 5, 8, 8, 8]
    assert trace.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert trace.is_prefill.tolist() == [True, True, True, False, False, True, True, False]
    assert trace.token_ids.tolist() == [100, 101, 102, 103, 104, 100, 101, 102]


def test_a_reused_sequence_id_gets_a_fresh_one():
    recorder = TraceRecorder(TOPOLOGY)
    _run(recorder, [1], [0])
    recorder.end_sequence(1)
    _run(recorder, [1], [0], step=1, base=3)
    trace = recorder.to_trace()
    assert trace.seq_ids.tolist() == [1, 2]
    assert trace.experts[0, 0].tolist() != trace.experts[1, 0].tolist()


def test_a_field_missing_from_some_iterations_is_dropped(trace):
    iterations = list(decode_stream(trace))
    gap = iterations[3]
    iterations[3] = dataclasses.replace(gap, events=tuple(dataclasses.replace(e, gate_weights=None) for e in gap.events))
    recorded = _record(iterations).to_trace()
    assert recorded.gate_weights is None and recorded.gate_probs is not None


def test_fields_can_be_left_out(trace):
    recorded = _record(decode_stream(trace), TraceRecorder(TOPOLOGY, fields=("token_ids",))).to_trace()
    assert recorded.hidden is None and recorded.tokens is None and recorded.token_ids is not None


def test_incomplete_or_malformed_iterations_raise():
    recorder = TraceRecorder(TOPOLOGY)
    with pytest.raises(TraceError, match="before begin_iteration"):
        recorder.observe(_events([0], [0], 0)[0])
    recorder.begin_iteration(_ctx(0, [0], [0], False))
    recorder.observe(_events([0], [0], 0)[0])
    with pytest.raises(TraceError, match="unexpected routing event for MoE layer 0"):
        recorder.observe(_events([0], [0], 0)[0])
    bad = RoutingEvent(1, np.zeros((2, 2), int), np.array([0, 0]), np.array([0, 1]))
    with pytest.raises(TraceError, match="expected"):
        recorder.observe(bad)
    with pytest.raises(TraceError, match="routed 1 of 3 MoE layers"):
        recorder.to_trace()


def test_empty_recorder_gives_an_empty_trace():
    trace = TraceRecorder(TOPOLOGY).to_trace()
    assert trace.num_tokens == 0 and trace.experts.shape == (0, 3, 2)


def test_recorded_trace_saves_and_loads(tmp_path, trace):
    recorder = _record(decode_stream(trace))
    recorder.set_text(0, "hello")
    path = save_trace(recorder.to_trace(), tmp_path / "rec.npz")
    loaded = load_trace(path)
    np.testing.assert_array_equal(loaded.experts, trace.experts)
    assert loaded.texts == {0: "hello"}
