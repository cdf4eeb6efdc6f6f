"""default: fit, online predictions equal to whole-trace scoring, calibration, eviction by
expected next use, save/load, and the error when it has no trained model."""

import dataclasses

import numpy as np
import pytest

from moestream.cache import ExpertCache
from moestream.eval.prediction import evaluate_predictor
from moestream.policies import POLICIES
from moestream.policies.default.model import DefaultConfig
from moestream.policies.default.policy import UntrainedPolicyError
from moestream.predictors.configs import TrainConfig
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import decode_stream
from moestream.trace.synthetic import synthetic_trace
from tests.policies.online import OnlineOnly

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4, 5), num_experts=8, top_k=2, expert_bytes=1024)
QUICK = TrainConfig(num_epochs=30, learning_rate=2e-2, batch_size=64)


@pytest.fixture(scope="module")
def traces():
    return synthetic_trace(TOPOLOGY, num_sequences=30, tokens_per_sequence=20, seed=1).split(0.3, seed=0)


@pytest.fixture(scope="module")
def policy(traces):
    policy = POLICIES.create("default", TOPOLOGY, train=QUICK)
    policy.fit(traces[0])
    return policy


def test_training_lowers_the_loss(policy):
    assert policy.predictor.losses[-1] < policy.predictor.losses[0]


@pytest.mark.parametrize("horizon", [1, 2, 3, 5])
def test_online_predictions_equal_whole_trace_scoring(policy, traces, horizon):
    test = traces[1]
    scored = evaluate_predictor(policy.predictor, test, horizon)
    policy.predictor.reset()
    online = evaluate_predictor(OnlineOnly(policy.predictor), test, horizon)
    np.testing.assert_array_equal(scored.hits, online.hits)
    np.testing.assert_array_equal(scored.predicted, online.predicted)


@pytest.mark.parametrize("overrides", [{"cut_recall": True}, {"hidden_units": 8}, {"hidden_units": 8, "cut_recall": True}])
def test_every_variant_predicts_online_what_it_scores(traces, overrides):
    config = dataclasses.replace(DefaultConfig(), **overrides)
    policy = POLICIES.create("default", TOPOLOGY, config=config, train=TrainConfig(num_epochs=3, batch_size=64))
    policy.fit(traces[0])
    assert set(policy.predictor.tensors()) >= ({"out", "out_bias"} if config.hidden_units else set())
    for horizon in (1, 3):
        scored = evaluate_predictor(policy.predictor, traces[1], horizon)
        policy.predictor.reset()
        online = evaluate_predictor(OnlineOnly(policy.predictor), traces[1], horizon)
        np.testing.assert_array_equal(scored.hits, online.hits)
        np.testing.assert_array_equal(scored.predicted, online.predicted)


def test_beats_chance_and_is_calibrated(policy, traces):
    test = traces[1]
    counts = evaluate_predictor(policy.predictor, test, 1)
    assert counts.f1() > 1.5 * TOPOLOGY.top_k / TOPOLOGY.num_experts
    probs = np.stack([policy.predictor.score_rows(test, layer, 1) for layer in range(TOPOLOGY.num_layers)], axis=1)
    routed = np.zeros(probs.shape, bool)  # [N, L, E]
    np.put_along_axis(routed, test.experts.astype(np.int64), True, axis=2)
    assert abs(probs.mean() - routed.mean()) < 0.05


def test_eviction_keeps_the_experts_it_expects_sooner(policy, traces):
    predictor, eviction = policy.predictor, policy.make_eviction("device")
    predictor.reset()
    it = next(decode_stream(traces[1]))
    predictor.begin_iteration(it.ctx)
    for event in it.events[:2]:
        predictor.observe(event)
    wait = predictor.expected_wait()  # [L, E]
    keys = [ExpertKey(layer, e) for layer in range(TOPOLOGY.num_layers) for e in range(TOPOLOGY.num_experts)]
    cache = ExpertCache(len(keys), eviction)
    for key in keys:
        cache.admit(key)
    victim = eviction.victim(keys)
    assert wait[victim] == wait.max()
    L, c = TOPOLOGY.num_layers, 1
    q = np.maximum(predictor.state.next, 1e-4)
    passed = np.arange(L) <= c  # only the next token can use them: layers until it reaches l, then L/q per use
    np.testing.assert_allclose(wait[passed], (np.arange(L)[passed] - c)[:, None] + L / q[passed], rtol=1e-5)
    ahead = ~passed
    p = predictor.state.ahead[ahead]
    np.testing.assert_allclose(wait[ahead], (np.arange(L)[ahead] - c)[:, None] + (1 - p) * L / q[ahead], rtol=1e-5)


def test_save_and_load_give_the_same_scores(policy, traces, tmp_path):
    policy.save(tmp_path / "lean")
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "lean")
    for layer in range(TOPOLOGY.num_layers):
        np.testing.assert_array_equal(loaded.predictor.score_rows(traces[1], layer, 1),
                                      policy.predictor.score_rows(traces[1], layer, 1))


def test_without_a_trained_model_it_stops_with_what_to_pass(traces):
    policy = POLICIES.create("default", TOPOLOGY)
    with pytest.raises(UntrainedPolicyError, match="--predictor-dir DIR.*train-predictor --kind default"):
        policy.prepare(traces[1])
    with pytest.raises(UntrainedPolicyError):
        policy.predictor.begin_iteration(next(decode_stream(traces[1])).ctx)


LOAD_AND_RUN = """
import sys
from moestream.policies import POLICIES
from moestream.trace.format import load_trace
from moestream.trace.replay import decode_stream
trace = load_trace(sys.argv[2])
policy = POLICIES.create("default", trace.topology, predictor_dir=sys.argv[1])
policy.predictor.score_rows(trace, 2, 1)
it = next(decode_stream(trace))
policy.predictor.begin_iteration(it.ctx)
policy.predictor.observe(it.events[0])
assert policy.predictor.predict(0, 2)
print("torch" in sys.modules)
"""


def test_loading_and_running_import_no_torch(policy, traces, tmp_path):
    import subprocess
    import sys

    from moestream.trace.format import save_trace

    policy.save(tmp_path / "lean")
    save_trace(traces[1], tmp_path / "test.npz")
    done = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(tmp_path / "lean"), str(tmp_path / "test.npz")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_sim_without_a_trained_model_exits_with_one_line(traces, tmp_path, capsys):
    from moestream.cli import main
    from moestream.trace.format import save_trace

    save_trace(traces[1], tmp_path / "test.npz")
    rc = main(["sim", "--trace", str(tmp_path / "test.npz"), "--policy", "default", "--cache-ratio", "0.25"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "--predictor-dir DIR" in errors[0]
