"""The background predictor: same predictions as inline after flush, latest results rebased, errors
surfaced, and the opt-in hook for policies."""

import threading
import time

import numpy as np
import pytest

from moestream.bench.sim.replay import batched_decode
from moestream.contracts import Prediction, Predictor
from moestream.events import IterationContext, RoutingEvent
from moestream.policies import POLICIES
from moestream.runtime.background import BackgroundPredictor, BackgroundTimeout, offload_predictor
from moestream.topology import Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=1)


@pytest.fixture
def wrappers():
    made = []

    def wrap(inner, synchronous=False):
        made.append(BackgroundPredictor(inner, synchronous=synchronous))
        return made[-1]

    yield wrap
    for wrapper in made:
        wrapper.close()


class Gated(Predictor):
    """Predicts layer_now+1 of this token and layer 0 of the next; observe waits for a gate."""

    def __init__(self):
        super().__init__(TOPOLOGY)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def observe(self, event):
        self.gate.wait(timeout=10)
        if self.fail:
            raise ValueError("broken predictor")

    def predict(self, layer_now, horizon_layers):
        return [Prediction(layer_now + 1, 0, 0.5), Prediction(0, 1, 0.25, tokens_ahead=1)]


def ctx(step):
    return IterationContext(step=step, seq_ids=np.array([0]), positions=np.array([step]), is_prefill=False)


def event(layer):
    return RoutingEvent(layer=layer, expert_ids=np.array([[0, 1]]), seq_ids=np.array([0]), positions=np.array([0]))


def test_after_flush_the_worker_gives_the_synchronous_predictions(wrappers):
    trace = synthetic_trace(TOPOLOGY, num_sequences=6, tokens_per_sequence=10, seed=4)
    inline = POLICIES.create("fmoe", TOPOLOGY)
    offloaded = POLICIES.create("fmoe", TOPOLOGY)
    for policy in (inline, offloaded):
        policy.fit(trace)
    background = wrappers(offloaded.predictor)
    compared = 0
    for it in batched_decode(trace, batch_size=3):
        inline.predictor.begin_iteration(it.ctx)
        background.begin_iteration(it.ctx)
        for e in it.events:
            inline.predictor.observe(e)
            background.observe(e)
            expected = inline.predictor.predict(e.layer, 2)
            background.predict(e.layer, 2)
            background.flush()
            assert background.predict(e.layer, 2) == expected
            compared += bool(expected)
        for seq in it.finished:
            inline.predictor.end_sequence(seq)
            background.end_sequence(seq)
    assert compared > 0
    np.testing.assert_array_equal(background.inner.store.maps, inline.predictor.store.maps)


def test_predict_answers_with_the_latest_completed_result_rebased(wrappers):
    inner = Gated()
    background = wrappers(inner)
    background.begin_iteration(ctx(0))
    inner.gate.clear()
    background.observe(event(0))
    assert background.predict(0, 2) == []  # the worker is still inside observe
    inner.gate.set()
    background.flush()
    assert background.predict(0, 2) == [Prediction(1, 0, 0.5), Prediction(0, 1, 0.25, tokens_ahead=1)]
    inner.gate.clear()
    background.observe(event(1))
    assert background.predict(1, 2) == [Prediction(0, 1, 0.25, tokens_ahead=1)]  # layer 1 has passed
    background.begin_iteration(ctx(1))
    assert background.predict(-1, 2) == [Prediction(0, 1, 0.25)]  # next token's layer 0 is now this one's
    inner.gate.set()
    background.flush()
    assert background.predict(-1, 2) == [Prediction(0, 0, 0.5), Prediction(0, 1, 0.25, tokens_ahead=1)]


def test_worker_errors_surface_in_the_caller(wrappers):
    inner = Gated()
    inner.fail = True
    background = wrappers(inner)
    background.observe(event(0))
    with pytest.raises(RuntimeError, match="background predictor failed"):
        background.flush()


def test_synchronous_mode_runs_inline_without_a_thread(wrappers):
    inner = Gated()
    background = wrappers(inner, synchronous=True)
    inner.fail = True
    with pytest.raises(ValueError, match="broken"):
        background.observe(event(0))  # raised by the call itself: nothing ran elsewhere
    assert background.predict(2, 1) == inner.predict(2, 1)


def test_only_policies_that_ask_are_offloaded():
    fmoe = POLICIES.create("fmoe", TOPOLOGY)
    wrapper = offload_predictor(fmoe)
    try:
        assert isinstance(wrapper, BackgroundPredictor) and fmoe.observers()[0] is wrapper
        assert offload_predictor(fmoe) is wrapper and wrapper.needs_embeddings
    finally:
        wrapper.close()
    lru = POLICIES.create("lru", TOPOLOGY)
    assert offload_predictor(lru) is None and not isinstance(lru.predictor, BackgroundPredictor)


def test_a_worker_that_falls_behind_makes_the_caller_wait_then_time_out(wrappers):
    inner = Gated()
    inner.gate.clear()  # the worker blocks in its first observe
    background = BackgroundPredictor(inner, max_pending=2, timeout_s=0.2)
    background.observe(event(0))  # taken by the worker, which now waits at the gate
    wait_for(lambda: background._jobs.empty())
    background.observe(event(1))
    background.observe(event(2))  # the queue is full now
    with pytest.raises(BackgroundTimeout, match="fell 2 jobs behind"):
        background.observe(event(3))
    with pytest.raises(BackgroundTimeout, match="did not catch up"):
        background.flush()
    inner.gate.set()
    background.close()  # the worker catches up and stops
    assert background._thread is None


def test_flush_and_close_wait_at_most_their_timeout(wrappers):
    inner = Gated()
    inner.gate.clear()
    background = BackgroundPredictor(inner, timeout_s=0.2)
    background.observe(event(0))
    with pytest.raises(BackgroundTimeout, match="did not catch up within 0.2 s"):
        background.flush()
    with pytest.raises(BackgroundTimeout, match="did not stop within 0.2 s"):
        background.close()
    inner.gate.set()


def test_flush_returns_after_a_worker_error_instead_of_hanging(wrappers):
    inner = Gated()
    inner.fail = True
    inner.gate.clear()  # both events queue before the first fails
    background = wrappers(inner)
    background.observe(event(0))
    background.observe(event(1))  # skipped once the worker has failed
    inner.gate.set()
    with pytest.raises(RuntimeError, match="background predictor failed"):
        background.flush()
    background.flush()  # the error was raised once; the worker still answers


def wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)
