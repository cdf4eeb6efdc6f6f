"""A tiny random checkpoint shared by the serving tests, an engine on it (one per test module), and a
routing trace it can replay."""

import pytest

from moestream.runtime import Engine, EngineConfig


@pytest.fixture(scope="session")
def serving_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen2_moe", num_layers=2)


@pytest.fixture(scope="module")
def engine(serving_checkpoint):
    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        yield engine


@pytest.fixture(scope="session")
def replay_trace(serving_checkpoint, tmp_path_factory):
    """A synthetic routing trace whose topology matches the serving checkpoint (for --replay-routing)."""
    from moestream.checkpoint.index import build_index
    from moestream.trace.format import save_trace
    from tests.synthetic import synthetic_trace

    topology = build_index(serving_checkpoint).topology
    path = tmp_path_factory.mktemp("replay") / "trace.npz"
    return save_trace(synthetic_trace(topology, num_sequences=2, tokens_per_sequence=16), path)
