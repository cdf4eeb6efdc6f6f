"""SimConfig validation."""

import pytest

from moestream.bench.sim import SimConfig, get_cost_model
from moestream.bench.sim.config import SimConfigError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cache_ratio": 0.0}, "cache ratio"),
        ({"cache_ratio": 1.2}, "cache ratio"),
        ({"cache_ratio": 0.1, "mode": "turbo"}, "unknown mode"),
        ({"cache_ratio": 0.1, "batch_size": 0}, "batch size"),
        ({"cache_ratio": 0.1, "host_cache_ratio": 0.5, "cost": get_cost_model("local-disk")}, "no host tier"),
        ({"cache_ratio": 0.1, "protocol_eviction": "fifo"}, "protocol eviction"),
    ],
)
def test_bad_settings_name_the_problem(kwargs, message):
    with pytest.raises(SimConfigError, match=message):
        SimConfig(**kwargs)


def test_host_tier_is_simulated_only_when_partial():
    assert not SimConfig(cache_ratio=0.1).has_host_tier
    assert SimConfig(cache_ratio=0.1, host_cache_ratio=0.5).has_host_tier
