"""default: fit, calibration, eviction by expected next use, and the error when it has no trained
model (online state: test_state.py; storage: test_storage.py)."""

import numpy as np
import pytest

from moestream.bench.sim.replay import decode_stream
from moestream.bench.tools.prediction import evaluate_predictor
from moestream.cache import ExpertCache
from moestream.policies import POLICIES
from moestream.policies.default.policy import UntrainedPolicyError
from moestream.topology import ExpertKey
from tests.policies.default.common import TOPOLOGY


def test_training_lowers_the_loss(policy):
    assert policy.predictor.losses[-1] < policy.predictor.losses[0]


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
    assert wait[victim] == wait.max()  # the waits themselves: test_reuse.py


def test_without_a_trained_model_it_stops_with_what_to_pass(traces):
    policy = POLICIES.create("default", TOPOLOGY)
    with pytest.raises(UntrainedPolicyError, match="--predictor-dir DIR.*train-predictor --kind default"):
        policy.prepare(traces[1])
    with pytest.raises(UntrainedPolicyError):
        policy.predictor.begin_iteration(next(decode_stream(traces[1])).ctx)


def test_sim_without_a_trained_model_exits_with_one_line(traces, tmp_path, capsys):
    from moestream.cli import main
    from moestream.trace.format import save_trace

    save_trace(traces[1], tmp_path / "test.npz")
    rc = main(["sim", "--trace", str(tmp_path / "test.npz"), "--policy", "default", "--cache-ratio", "0.25"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and "--predictor-dir DIR" in errors[0]


@pytest.mark.parametrize("num_pinned", [3, 12])  # a few argmax tries; more than max_argmax: one ranking
def test_eviction_passes_over_pinned_experts_to_the_longest_wait_left(policy, traces, num_pinned):
    predictor, eviction = policy.predictor, policy.make_eviction("device")
    predictor.reset()
    it = next(decode_stream(traces[1]))
    predictor.begin_iteration(it.ctx)
    predictor.observe(it.events[0])
    wait = predictor.expected_wait()  # [L, E]
    keys = [ExpertKey(layer, e) for layer in range(TOPOLOGY.num_layers) for e in range(TOPOLOGY.num_experts)]
    longest = sorted(keys, key=lambda key: wait[key], reverse=True)
    cache = ExpertCache(len(keys) - 1, eviction)
    for key in longest[:-1]:
        cache.admit(key)
    cache.pin(longest[:num_pinned])
    _, evicted = cache.admit(longest[-1])
    assert wait[evicted] == max(wait[key] for key in longest[num_pinned:-1])
    assert all(key in cache for key in longest[:num_pinned])


@pytest.mark.parametrize("every", [1, 3])  # victims asked at every layer, or every third (rows of several layers)
def test_victims_follow_the_longest_expected_wait_as_layers_pass(policy, traces, every):
    """The eviction keeps its table in step row by row; each victim must still be the candidate a full
    ranking of the predictor's expected waits gives (ties to the smaller key)."""
    predictor, eviction = policy.predictor, policy.make_eviction("device")
    predictor.reset()
    cache = ExpertCache(TOPOLOGY.total_experts // 3, eviction)
    rng, checked = np.random.default_rng(0), 0
    for it in decode_stream(traces[1]):
        predictor.begin_iteration(it.ctx)
        for event in it.events:
            predictor.observe(event)
            if event.layer % every:
                continue
            needed = [ExpertKey(event.layer, int(e)) for e in event.expert_ids.ravel()]
            for key in [*needed, ExpertKey(int(rng.integers(TOPOLOGY.num_layers)), int(rng.integers(8)))]:
                if key in cache:
                    continue
                wait, candidates = predictor.expected_wait(), [k for k in cache.evictable() if k not in needed]
                expected = min(candidates, key=lambda k: (-wait[k], k)) if len(cache) == cache.capacity else None
                _, evicted = cache.admit(key, protect=needed)
                assert evicted == expected
                checked += evicted is not None
        for seq in it.finished:
            predictor.end_sequence(seq)
    assert checked > 100
