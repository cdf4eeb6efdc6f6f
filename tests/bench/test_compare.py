"""Side-by-side comparison: one replay per (protocol, cost, policy, ratio), prediction quality,
overhead, skipped policies, trained predictors loaded instead of fitted, and where default loses."""

import numpy as np
import pytest

from moestream.bench.policies import default_losses
from moestream.bench.sim.replay import head_tokens
from moestream.bench.tools.compare import CompareConfig, CompareError, Comparison, compare
from moestream.cli import main
from moestream.topology import Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=1 << 20)


@pytest.fixture(scope="module")
def traces():
    train = synthetic_trace(TOPOLOGY, num_sequences=6, tokens_per_sequence=12, seed=1)
    test = synthetic_trace(TOPOLOGY, num_sequences=3, tokens_per_sequence=12, seed=2)
    return train, test


def _config(**fields):
    base = dict(policies=("lru", "belady", "token"), cache_ratios=(0.25, 0.5), cost_models=("pcie4-consumer",),
                horizons=(1, 2), num_workers=1, num_overhead_tokens=12)
    return CompareConfig(**(base | fields))


def test_every_setting_is_replayed_and_bounds_hold(traces):
    train, test = traces
    result = compare(train, test, _config(policies=("lru", "belady", "token", "promoe")))
    stream = result.replays["stream"]["pcie4-consumer"]
    assert set(stream) == {"lru", "belady", "token"} and set(stream["lru"]) == {0.25, 0.5}
    assert set(result.replays["moe-beyond"]) == {"pcie4-consumer"}  # cost-free: replayed once
    for ratio in (0.25, 0.5):
        assert stream["belady"][ratio]["hit_rate"] >= stream["lru"][ratio]["hit_rate"]
    assert stream["lru"][0.5]["hit_rate"] >= stream["lru"][0.25]["hit_rate"]
    assert set(result.prediction["token"]) == {1, 2} and 0.0 <= result.prediction["token"][1]["f1"] <= 1.0
    assert result.prediction["lru"] == {}  # predicts nothing
    assert all(us > 0 for us in result.overhead_us_per_layer.values())
    assert "hidden" in result.skipped["promoe"]


def test_a_trained_predictor_directory_replaces_fitting(traces, tmp_path):
    train, _ = traces
    from moestream.trace.format import save_trace

    path = save_trace(train, tmp_path / "train.npz")
    out = tmp_path / "ef"
    assert main(["train-predictor", "--kind", "expertflow", "--trace", str(path), "--out", str(out), "--epochs", "1",
                 "--set", "model_dim=16", "--set", "num_heads=2", "--set", "window_tokens=4", "--no-progress"]) == 0
    from moestream.bench.tools.compare import fit_policies

    config = _config(policies=("expertflow", "expertflow-nocorrect", "lru"), predictor_dirs=(str(out),))
    fitted = fit_policies(train, train, config, Comparison())
    assert fitted["expertflow"].config.model_dim == 16 == fitted["expertflow-nocorrect"].config.model_dim
    assert fitted["expertflow"].pretrained and not hasattr(fitted["lru"], "pretrained")


def test_a_predictor_kind_is_trained_once_and_shared_by_its_policies(traces):
    from moestream.bench.tools.compare import fit_policies

    train, _ = traces
    fitted = fit_policies(train, train, _config(policies=("expertflow", "expertflow-nocorrect")), Comparison())
    first, second = fitted["expertflow"], fitted["expertflow-nocorrect"]
    assert not first.pretrained and second.pretrained  # fitted once, then loaded
    for layer in range(3):
        scores = [policy.predictor.score_rows(train, layer, 1) for policy in (first, second)]
        np.testing.assert_allclose(scores[1], scores[0])


def test_default_losses_name_the_setting_and_ignore_offline_bounds():
    metrics = lambda hit, stall: {"hit_rate": hit, "stall_ms_per_token": stall}  # noqa: E731
    result = Comparison(fit_seconds={"default": 1.0, "lru": 0.0, "oracle": 0.0})
    result.replays = {"stream": {"pcie4-consumer": {
        "default": {0.1: metrics(0.5, 2.0), 0.25: metrics(0.7, 1.0)},
        "lru": {0.1: metrics(0.6, 1.5), 0.25: metrics(0.6, 1.5)},
        "oracle": {0.1: metrics(0.9, 0.1), 0.25: metrics(0.9, 0.1)},
    }}}
    losses = list(default_losses(result))
    assert len(losses) == 2 and all("ratio 0.1: lru" in loss for loss in losses)


def test_head_tokens_keeps_whole_sequences(traces):
    _, test = traces
    head = head_tokens(test, 13)
    assert head.num_tokens == 24 and len(head.sequence_ids()) == 2
    assert head_tokens(test, 10_000) is test
    np.testing.assert_array_equal(head.experts, test.experts[:24])


def test_bad_settings_are_refused():
    with pytest.raises(CompareError, match="cache ratios"):
        _config(cache_ratios=(0.0,))
    with pytest.raises(CompareError, match="no policy"):
        _config(policies=())
