"""The asynchronous engine generates exactly what the synchronous one does, under any policy, chunk
size, reordering, injected delays and failures, and shuts down cleanly."""

import os
import random
import threading
import time

import pytest
import torch

import moestream.runtime.engine as engine_module
from moestream.checkpoint.index import build_index
from moestream.contracts import Observer
from moestream.policies import POLICIES
from moestream.policies.trained import TrainedPolicy
from moestream.predictors.configs import TrainConfig
from moestream.runtime import Engine, EngineConfig
from moestream.store import ExpertStore, ThreadedExecutor
from moestream.store.transfer import TransferError
from moestream.trace.recorder import TraceRecorder
from tests.runtime.conftest import PROMPTS

ONLINE_POLICIES = [name for name in POLICIES.names() if not POLICIES.get(name).offline]
MODES = {  # name -> EngineConfig settings
    "sync": dict(sync=True),
    "sync, no prefetch": dict(sync=True, horizon_layers=0),
    "async": dict(),
    "async, small chunks, no reorder": dict(chunk_bytes=512, reorder=False),
    "async, no prefetch": dict(horizon_layers=0),
}


def _min_budget(path) -> str:
    topology = build_index(path).topology
    return f"{2 * topology.top_k * topology.expert_bytes}B"


def _engine(path, policy=None, **config) -> Engine:
    return Engine(path, EngineConfig(expert_budget=_min_budget(path), direct_io=False, **config), policy=policy)


@pytest.fixture(scope="module")
def mixtral(checkpoint):
    return checkpoint("mixtral")


@pytest.fixture(scope="module")
def trace(mixtral):
    with Engine(mixtral, EngineConfig(expert_budget="1.0", direct_io=False, publish_gate_probs=True,
                                      publish_hidden=True)) as engine:
        recorder = TraceRecorder(engine.checkpoint.topology)
        engine.add_observer(recorder)
        for prompt in PROMPTS:
            engine.generate([prompt], max_new_tokens=6)
    return recorder.to_trace()


def _policy(name, trace):
    cls = POLICIES.get(name)
    extra = {"train": TrainConfig(num_epochs=1)} if issubclass(cls, TrainedPolicy) else {}
    policy = cls(trace.topology, **extra)
    policy.fit(trace)
    return policy


def _generate(path, policy, prompts, steps=2, **config) -> list[list[int]]:
    with _engine(path, policy, **config) as engine:
        return [engine.generate(prompts, max_new_tokens=5).token_ids for _ in range(steps)]


@pytest.mark.parametrize("name", ONLINE_POLICIES)
def test_every_policy_generates_the_same_in_every_mode(mixtral, trace, name):
    prompts = list(PROMPTS[:2])
    outputs = {mode: _generate(mixtral, _policy(name, trace), prompts, **config) for mode, config in MODES.items()}
    assert all(tokens == outputs["sync"] for tokens in outputs.values()), outputs


def test_logits_are_bit_identical_whatever_the_order_of_arrival(mixtral):
    ids = torch.tensor([[5, 9, 33, 2, 17, 40, 8, 1]])
    logits = {}
    for mode, config in MODES.items():
        with _engine(mixtral, **config) as engine, torch.no_grad():
            logits[mode] = engine.model(input_ids=ids).logits
    for mode, value in logits.items():
        assert torch.equal(value, logits["sync"]), mode


def test_async_mode_uses_the_asynchronous_store(mixtral):
    with _engine(mixtral) as engine:
        assert isinstance(engine.store.executor, ThreadedExecutor)
        result = engine.generate(["A prompt"], max_new_tokens=3)
    assert result.metrics.expert_misses > 0 and result.metrics.transfer_ms > 0


class FaultyReader:
    """The store's reader with random delays and, when asked, random failures."""

    def __init__(self, inner, rng, failure_rate=0.0):
        self.inner, self.rng, self.failure_rate = inner, rng, failure_rate

    def read_batch(self, batch):
        time.sleep(self.rng.random() * 0.003)
        if self.rng.random() < self.failure_rate:
            raise OSError("injected read failure")
        return self.inner.read_batch(batch)

    def close(self):
        self.inner.close()


def _counts() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def test_random_delays_keep_outputs_identical_over_many_steps(mixtral, trace):
    prompts = list(PROMPTS)
    expected = _generate(mixtral, _policy("cooccur", trace), prompts, steps=3, sync=True)
    before = _counts()
    with _engine(mixtral, _policy("cooccur", trace), chunk_bytes=1024) as engine:
        engine.store.reader = FaultyReader(engine.store.reader, random.Random(1))
        got = [engine.generate(prompts, max_new_tokens=5).token_ids for _ in range(3)]
    assert got == expected
    assert _counts() == before


def test_a_failed_read_is_a_clear_error_not_a_hang(mixtral):
    before = _counts()
    with _engine(mixtral, transfer_timeout_s=20) as engine:
        engine.store.reader = FaultyReader(engine.store.reader, random.Random(2), failure_rate=0.2)
        with pytest.raises(TransferError, match="injected read failure"):
            for _ in range(20):
                engine.generate(list(PROMPTS), max_new_tokens=5)
        engine.store.reader.failure_rate = 0.0
        again = engine.generate(list(PROMPTS), max_new_tokens=5).token_ids
    assert again == _generate(mixtral, None, list(PROMPTS), steps=1, sync=True)[0]
    assert _counts() == before


class Interrupt(Observer):
    """Presses Ctrl-C at the n-th routing event."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def observe(self, event):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt


def test_ctrl_c_during_generate_then_close_shuts_down_cleanly(mixtral):
    before = _counts()
    with _engine(mixtral, policy=None) as engine:
        interrupt = Interrupt(at=5)
        engine.add_observer(interrupt)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(list(PROMPTS), max_new_tokens=5)
        interrupt.at = -1
        again = engine.generate(list(PROMPTS), max_new_tokens=5).token_ids
    assert again == _generate(mixtral, None, list(PROMPTS), steps=1, sync=True)[0]
    assert _counts() == before


@pytest.fixture
def tiered(monkeypatch):
    """Engines built while it is active keep their tiers apart, as open_store does on CUDA: an asynchronous
    engine with a host tier gets the two-tier store, here on the CPU link (on the CPU open_store merges them)."""
    monkeypatch.setattr(engine_module, "open_store", _open_tiers_apart)


def _open_tiers_apart(index, config, *args, **kwargs):
    return ExpertStore(index, config, *args, **kwargs)


@pytest.mark.parametrize("name", ["lru", "cooccur"])
def test_the_two_tier_store_generates_the_same_as_sync(mixtral, trace, tiered, name):
    prompts = list(PROMPTS[:2])
    host = dict(host_budget="0.75")
    expected = _generate(mixtral, _policy(name, trace), prompts, sync=True, **host)
    for config in (dict(), dict(chunk_bytes=512, reorder=False)):
        with _engine(mixtral, _policy(name, trace), **host, **config) as engine:
            assert isinstance(engine.store.executor, ThreadedExecutor) and engine.store.host_slots > 0
            got = [engine.generate(prompts, max_new_tokens=5).token_ids for _ in range(2)]
            stats = engine.store.stats()
        assert got == expected, config
        assert stats.host_hits > 0 and stats.copy_s > 0 and stats.transfer_s > 0


def test_the_two_tier_store_under_random_delays_and_failures_is_exact_or_fails_clearly(mixtral, tiered):
    prompts, before = list(PROMPTS), _counts()
    expected = _generate(mixtral, None, prompts, steps=1, sync=True)[0]
    with _engine(mixtral, host_budget="0.75", chunk_bytes=1024, transfer_timeout_s=20) as engine:
        engine.store.reader = FaultyReader(engine.store.reader, random.Random(3))
        assert engine.generate(prompts, max_new_tokens=5).token_ids == expected
        engine.store.reader.failure_rate = 0.2
        with pytest.raises(TransferError, match="injected read failure"):
            for _ in range(20):
                engine.generate(prompts, max_new_tokens=5)
        engine.store.reader.failure_rate = 0.0
        assert engine.generate(prompts, max_new_tokens=5).token_ids == expected
    assert _counts() == before
