"""The offloaded engine generates exactly what the unmodified transformers model generates."""

import os

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info

from moestream.checkpoint.index import build_index
from moestream.contracts import Observer
from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.policies.trained import TrainedPolicy
from moestream.predictors.configs import TrainConfig
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.onednn import CACHE_ENTRIES
from moestream.trace.recorder import TraceRecorder
from tests.conftest import SAMPLE_FAMILIES
from tests.runtime.conftest import PROMPTS, auto_class, left_pad, reference_generate

BUDGETS = ("min", "0.5", "1.0")
NEW_TOKENS = 6


def _engine(path, budget="0.5", policy=None, **config) -> Engine:
    if budget == "min":
        topology = build_index(path).topology
        budget = f"{topology.top_k * topology.expert_bytes}B"
    return Engine(path, EngineConfig(expert_budget=budget, direct_io=False, **config), policy=policy)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """family -> (checkpoint, reference model loaded with default settings), built once."""
    made = {}

    def get(family):
        if family not in made:
            path = checkpoint(family)
            made[family] = path, auto_class(family).from_pretrained(path).eval()
        return made[family]

    return get


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", SAMPLE_FAMILIES)
def test_greedy_batch_matches_transformers(reference, family, budget):
    path, model = reference(family)
    with _engine(path, budget) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        result = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        pad_id = engine.pad_id
    assert result.token_ids == reference_generate(model, prompts, NEW_TOKENS, pad_id)
    assert (result.metrics.expert_misses > 0) == (budget != "1.0")  # a full budget preloads every expert


@pytest.mark.parametrize("family", SAMPLE_FAMILIES)
def test_forward_logits_match_transformers(reference, family):
    path, model = reference(family)
    with _engine(path, "min") as engine:
        ids, mask = left_pad([engine.encode(p) for p in PROMPTS], engine.pad_id)
        inputs = dict(input_ids=ids, attention_mask=mask)
        if model.config.is_encoder_decoder:
            inputs["decoder_input_ids"] = ids[:, -3:]
        with torch.no_grad():
            ours = engine.model(**inputs).logits
            theirs = model(**inputs).logits
    keep = mask.bool() if not model.config.is_encoder_decoder else slice(None)
    torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-4, atol=1e-4)


ONLINE_POLICIES = [name for name in POLICIES.names() if not POLICIES.get(name).offline]


@pytest.fixture(scope="module")
def recorded_trace(reference):
    """The routing (with router inputs) of a few prompts on the mixtral checkpoint."""
    path, _ = reference("mixtral")
    with _engine(path, "1.0", publish_gate_probs=True, publish_hidden=True) as engine:
        recorder = TraceRecorder(engine.checkpoint.topology)
        engine.add_observer(recorder)
        for prompt in PROMPTS:
            engine.generate([prompt], max_new_tokens=8)
    return recorder.to_trace()


@pytest.mark.parametrize("name", ONLINE_POLICIES)
def test_every_online_policy_keeps_tokens_exact(reference, recorded_trace, name):
    path, model = reference("mixtral")
    cls = POLICIES.get(name)
    extra = {"train": TrainConfig(num_epochs=1)} if issubclass(cls, TrainedPolicy) else {}
    policy = cls(recorded_trace.topology, **extra)
    policy.fit(recorded_trace)
    with _engine(path, "min", policy=policy) as engine:
        prompts = [engine.encode(p) for p in PROMPTS[:2]]
        result = engine.generate(prompts, max_new_tokens=4)
        assert result.token_ids == reference_generate(model, prompts, 4, engine.pad_id)


@pytest.mark.parametrize("sync", [True, False])
def test_misses_read_disk_and_preloaded_experts_are_hits(checkpoint, sync):
    path = checkpoint("qwen3_moe")
    with _engine(path, "0.5", sync=sync) as engine:
        expert_bytes = engine.checkpoint.topology.expert_bytes
        first = engine.generate(["A first prompt"], max_new_tokens=3).metrics
    assert first.expert_misses > 0 and first.bytes_read["disk"] == first.expert_misses * expert_bytes
    assert first.transfer_ms > 0 and (first.stall_ms > 0 if sync else first.stall_ms >= 0)  # async may hide it all
    with _engine(path, "1.0", sync=sync) as engine:
        assert len(engine.store.resident()) == engine.checkpoint.topology.total_experts  # preloaded at start
        assert engine.preload() == 0
        again = engine.generate(["A first prompt"], max_new_tokens=3).metrics
    assert again.expert_misses == 0 and again.bytes_read["disk"] == 0 and again.stall_ms == 0
    assert again.expert_hits == first.expert_hits + first.expert_misses


def test_the_preload_bar_is_plain_lines_where_stderr_is_not_a_terminal(checkpoint, capsys):
    with Engine(checkpoint("qwen3_moe"), EngineConfig(expert_budget="1.0", direct_io=False), progress=True):
        pass
    err = capsys.readouterr().err
    assert "loading experts" in err and "100%" in err and "\r" not in err and "\x1b[" not in err


class Recorder(Observer):
    """Checks the call order and, at each routing event, how many experts the store has looked up."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    def begin_iteration(self, ctx):
        self.calls.append(("begin", ctx))

    def observe(self, event):
        stats = self.engine.store.stats()
        self.calls.append(("observe", event, stats.hits + stats.misses))

    def end_sequence(self, seq_id):
        self.calls.append(("end", seq_id))


def test_routing_is_published_before_its_experts_run(checkpoint):
    with _engine(checkpoint("olmoe"), "0.5", publish_gate_probs=True) as engine:
        recorder = Recorder(engine)
        engine.add_observer(recorder)
        result = engine.generate(["Some words here", "More"], max_new_tokens=3)
        num_layers = engine.checkpoint.topology.num_layers
    events = [call for call in recorder.calls if call[0] == "observe"]
    looked_up = 0
    for _, event, lookups_before in events:
        assert lookups_before == looked_up  # this layer's experts were not fetched yet
        looked_up += len(event.experts())
    assert [call[1].layer for call in events] == list(range(num_layers)) * 3
    assert sorted(call[1] for call in recorder.calls if call[0] == "end") == sorted(result.seq_ids)


def test_events_describe_the_real_tokens(checkpoint):
    with _engine(checkpoint("olmoe"), "0.5", publish_gate_probs=True) as engine:
        recorder = Recorder(engine)
        engine.add_observer(recorder)
        prompts = [engine.encode("Some words here"), engine.encode("More")]
        engine.generate(prompts, max_new_tokens=3)
        num_experts = engine.checkpoint.topology.num_experts
    ctx = None
    for call in recorder.calls:
        if call[0] == "begin":
            ctx = call[1]
        elif call[0] == "observe":
            event = call[1]
            np.testing.assert_array_equal(event.seq_ids, ctx.seq_ids)
            np.testing.assert_array_equal(event.positions, ctx.positions)
            assert event.gate_probs.shape == (ctx.num_tokens, num_experts)
            np.testing.assert_allclose(event.gate_probs.sum(axis=1), 1.0, rtol=1e-5)
            picked = np.take_along_axis(event.gate_probs, event.expert_ids, axis=1)
            assert (picked.min(axis=1) >= np.sort(event.gate_probs, axis=1)[:, -event.expert_ids.shape[1]] - 1e-6).all()
    prefill = recorder.calls[0][1]
    assert prefill.is_prefill and prefill.num_tokens == sum(len(p) for p in prompts)
    assert prefill.token_ids.tolist() == prompts[0] + prompts[1]


def test_bad_generation_requests_are_user_errors(checkpoint):
    with _engine(checkpoint("mixtral"), "0.5") as engine:
        with pytest.raises(MoestreamError, match="max_new_tokens"):
            engine.generate(["hi"], max_new_tokens=0)
        with pytest.raises(MoestreamError, match="token ids"):
            engine.generate([[10**9]], max_new_tokens=1)
        with pytest.raises(MoestreamError, match="non-empty"):
            engine.generate([], max_new_tokens=1)


def test_a_host_tier_serves_repeated_misses_without_disk(reference):
    path, model = reference("qwen2_moe")
    with _engine(path, "min", host_budget="1.0", sync=True) as engine:  # async on the CPU: one tier
        prompts = [engine.encode(p) for p in PROMPTS]
        first = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        again = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert first.token_ids == again.token_ids == reference_generate(model, prompts, NEW_TOKENS, engine.pad_id)
    assert again.metrics.expert_misses > 0 and again.metrics.bytes_read["disk"] == 0
    assert again.metrics.bytes_read["host"] > 0


def _blas_threads() -> list[int]:
    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


def test_numpy_blas_runs_one_thread_while_an_engine_is_open(checkpoint):
    before = _blas_threads()
    if max(before, default=1) == 1:
        pytest.skip("numpy's BLAS already runs one thread here (or threadpoolctl controls none)")
    with _engine(checkpoint("olmoe")) as engine:
        engine.generate([PROMPTS[0]], 2)
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == before


def test_an_engine_on_the_cpu_bounds_onednn_s_shape_caches_unless_the_user_did(checkpoint, monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "")  # so that teardown restores the environment as it was
    monkeypatch.delenv("LRU_CACHE_CAPACITY")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    with _engine(checkpoint("olmoe")):
        assert os.environ["LRU_CACHE_CAPACITY"] == str(CACHE_ENTRIES)
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


def test_the_planner_sees_the_modelled_link_of_the_runs_fixed_figures(checkpoint):
    """--link-gbps and --layer-ms give the planner's view a modelled link (none without them)."""
    from moestream.contracts import Policy, Prediction, Predictor, PrefetchPlanner

    class NextLayer(Predictor):
        def predict(self, layer_now, horizon_layers):
            num_layers = self.topology.num_layers
            return [Prediction((layer_now + 1) % num_layers, 0, 0.9, int(layer_now + 1 >= num_layers))]

    class Recording(PrefetchPlanner):
        def __init__(self):
            self.links = []

        def plan(self, predictions, view):
            self.links.append(view.link)
            return []

    class Watched(Policy):
        def make_predictor(self):
            return NextLayer(self.topology)

        def make_planner(self):
            return Recording()

    path = checkpoint("qwen3_moe")
    seen = {}
    for figures in ({}, {"link_gbps": 2.0, "layer_ms": 4.0}):
        policy = Watched(build_index(path).topology)
        with _engine(path, "0.5", policy=policy, **figures) as engine:
            engine.generate(["A first prompt"], max_new_tokens=2)
            seen[bool(figures)] = policy.planner.links
    assert seen[False] and all(link is None for link in seen[False])
    link = seen[True][-1]
    assert (link.bytes_per_ms, link.layer_ms) == (2.0e6, 4.0) and link.next_need_ms >= 4.0
