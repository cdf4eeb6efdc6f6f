"""A tiny random checkpoint shared by the serving tests, and an engine on it (one per test module)."""

import pytest

from moestream.runtime import Engine, EngineConfig


@pytest.fixture(scope="session")
def serving_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen2_moe", num_layers=2)


@pytest.fixture(scope="module")
def engine(serving_checkpoint):
    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        yield engine
