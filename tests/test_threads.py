"""How many threads compute uses: what the user asks, else the cores the engine's own threads leave."""

import pytest
import torch

from moestream import threads
from moestream.runtime import Engine, EngineConfig


@pytest.mark.parametrize("cores, engine_threads, current, expected", [
    (8, 1, 8, 7), (8, 2, 8, 6), (2, 1, 2, 1), (2, 0, 2, 2), (1, 1, 1, 1), (2, 3, 2, 1), (8, 1, 4, 4),
])
def test_the_default_leaves_the_engine_s_threads_their_cores(monkeypatch, cores, engine_threads, current, expected):
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    assert threads.compute_threads(0, engine_threads, current) == expected
    assert threads.compute_threads(3, engine_threads, current) == 3  # what the user asks wins


def test_available_cores_follows_the_affinity_mask():
    assert 1 <= threads.available_cores() <= len(__import__("os").sched_getaffinity(0))


@pytest.fixture
def all_cores():
    """torch's own default (every core) while the test runs; the suite's single thread again after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads.available_cores())
    yield threads.available_cores()
    torch.set_num_threads(before)


@pytest.mark.parametrize("sync", [False, True])
def test_an_engine_computes_on_the_cores_its_own_threads_leave_and_puts_torch_back(tiny_checkpoint, all_cores, sync):
    with Engine(tiny_checkpoint("qwen2_moe", num_layers=2), EngineConfig(direct_io=False, sync=sync)) as engine:
        beside = engine.store.executor.num_threads
        assert beside == (0 if sync else 1)
        assert torch.get_num_threads() == engine.threads.num_threads == max(1, all_cores - beside)
        assert f"compute uses {engine.threads.num_threads} thread" in str(engine.threads)
        engine.generate(["The experts are"], 2)
    assert torch.get_num_threads() == all_cores


def test_num_threads_sets_torch_s_count_while_the_engine_is_open(tiny_checkpoint):
    before = torch.get_num_threads()
    with Engine(tiny_checkpoint("qwen2_moe", num_layers=2), EngineConfig(direct_io=False, num_threads=3)) as engine:
        assert torch.get_num_threads() == engine.threads.num_threads == 3
    assert torch.get_num_threads() == before
