"""The default routing model's arrays: members joined into one network give the mean of their logits;
the latest layers are embedded again the same way in training and online; settings out of range are refused."""

import numpy as np
import pytest
import torch

from moestream.policies.default.policy import DefaultConfig
from moestream.policies.default.model import ModelConfig, RoutingWeights, join_members, summed_rows
from moestream.policies.default.training import RoutingNet
from moestream.predictors.configs import ConfigError
from moestream.predictors.training import multi_hot

L, E, V, D, K = 3, 5, 7, 6, 2


def _member(rng, hidden=4):
    shapes = {
        "prefix": (L, E, hidden), "gate": (L, E, hidden), "token": (V, hidden), "position": (12, hidden),
        "previous": (L * E, hidden), "target": (L, hidden), "horizon": (L, hidden), "norm_w": (hidden,),
        "norm_b": (hidden,), "out_w": (L, hidden, E), "out_b": (L, E), "skip": (2, L, E),
        "hidden_in": (L, D, hidden), "hidden_out": (L, 3, hidden, E), "recall_in": (L, E, hidden), "recall_skip": (L, E),
        "recent": (2, L, E, hidden),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _logits(weights: RoutingWeights, rng_seed=1):
    rng = np.random.default_rng(rng_seed)
    tokens, buckets = rng.integers(0, V, 4), rng.integers(0, 12, 4)
    prev = rng.integers(0, E, (4, L, K))
    base = weights.context(tokens, buckets, prev, np.array([1.0, 0.0, 1.0, 1.0], np.float32))
    base = base + weights.prefix_step(0, rng.integers(0, E, (4, K)), rng.random((4, E)).astype(np.float32))
    base = base + weights.recent_step(1, rng.integers(0, E, (4, L, K)))
    latest = weights.latest(rng.standard_normal((4, D)), 0)
    targets, horizons = np.array([1, 2]), np.array([1, 3])
    hot, affinity, recall = (rng.random((4, 2, E)).astype(np.float32) for _ in range(3))
    return weights.logits(base, targets, horizons, hot, affinity, latest, {"recall": recall})


@pytest.mark.parametrize("count", [1, 3])
def test_joined_members_give_the_mean_of_their_logits(count):
    rng = np.random.default_rng(0)
    members = [_member(rng) for _ in range(count)]
    joined = RoutingWeights(join_members(members))
    mean = np.mean([_logits(RoutingWeights(member)) for member in members], axis=0)
    np.testing.assert_allclose(_logits(joined), mean, rtol=1e-4, atol=1e-4)
    assert (joined.num_members, joined.hidden_dim) == (count, 4 * count)


def test_joined_weights_keep_their_member_count_through_their_arrays():
    members = [_member(np.random.default_rng(seed)) for seed in range(2)]
    joined = RoutingWeights(join_members(members))
    again = RoutingWeights(joined.arrays())
    assert again.num_members == 2
    np.testing.assert_allclose(_logits(again), _logits(joined), rtol=1e-6)


def test_weights_without_a_member_count_are_one_network():
    assert RoutingWeights(_member(np.random.default_rng(0))).num_members == 1


def test_the_latest_layers_are_embedded_again_apart_from_the_prefix():
    weights = RoutingWeights(_member(np.random.default_rng(0)))
    experts = np.array([[[0, 1], [2, 3], [4, 0]]])  # [1, L, K]
    recent = weights.recent
    assert not weights.recent_step(-1, experts).any()
    np.testing.assert_allclose(weights.recent_step(0, experts)[0], recent[0, 0, 0] + recent[0, 0, 1], rtol=1e-6)
    both = recent[0, 2, 4] + recent[0, 2, 0] + recent[1, 1, 2] + recent[1, 1, 3]  # layer 2, then layer 1
    np.testing.assert_allclose(weights.recent_step(2, experts)[0], both, rtol=1e-5)


def test_weights_saved_without_the_recent_layers_add_nothing():
    arrays = _member(np.random.default_rng(0))
    del arrays["recent"]
    weights = RoutingWeights(arrays)
    assert not weights.recent_step(2, np.zeros((3, L, K), dtype=np.int64)).any()
    assert weights.arrays()["recent"].shape == (0, L, E, 4)


def test_training_embeds_the_latest_layers_as_the_online_model_does():
    torch.manual_seed(0)
    net = RoutingNet(L, E, V, ModelConfig(hidden_dim=4, num_recent_layers=2, use_memory=False), gate=False)
    weights = RoutingWeights(net.arrays() | {"num_members": np.array([1])})
    rng = np.random.default_rng(1)
    experts = np.argsort(rng.random((5, L, E)), axis=2)[:, :, :K]  # distinct experts, as a router picks them
    cuts = rng.integers(-1, L, (5, L))
    trained = net._recent(multi_hot(experts, E), torch.from_numpy(cuts)).detach().numpy()  # [n, L, H]
    for n, target in np.ndindex(cuts.shape):
        online = weights.recent_step(int(cuts[n, target]), experts[n : n + 1])[0]
        np.testing.assert_allclose(trained[n, target], online, rtol=1e-5, atol=1e-6)


def test_no_recent_layers_is_the_ablation():
    net = RoutingNet(L, E, V, ModelConfig(hidden_dim=4, num_recent_layers=0, use_memory=False), gate=False)
    assert "recent" not in net.arrays()


def test_summed_rows_add_the_named_rows_repeats_included():
    table = np.random.default_rng(0).standard_normal((7, 3)).astype(np.float32)
    index = np.array([[0, 6, 6], [2, 3, 4]])
    out = summed_rows(table, index)
    assert out.shape == (2, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out, table[index].sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize("field", ["num_members", "hidden_dim", "memory_rows", "min_token_count"])
def test_counts_below_one_are_refused_by_name(field):
    with pytest.raises(ConfigError, match=f"^{field} must be >= 1, got 0$"):
        DefaultConfig(**{field: 0})


def test_the_policys_own_settings_are_checked_after_the_models():
    with pytest.raises(ConfigError, match="reuse_tokens"):
        DefaultConfig(reuse_tokens=0)
    with pytest.raises(ConfigError, match="^min_train_steps must be >= 0"):
        DefaultConfig(min_train_steps=-1)
    with pytest.raises(ConfigError, match="^num_recent_layers must be >= 0, got -1$"):
        DefaultConfig(num_recent_layers=-1)
    config = DefaultConfig(hidden_dim=7, num_members=3, reuse_l2=0.5)
    assert config.model().hidden_dim == 7 and config.model().num_members == 3
    assert not hasattr(config.model(), "reuse_l2")
