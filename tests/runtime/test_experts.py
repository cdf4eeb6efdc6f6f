"""The experts implementation computes what transformers' own experts modules compute."""

import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moestream.checkpoint.index import build_index
from moestream.families import FAMILIES
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.expert_math import FusedExpertMath
from moestream.runtime.experts import IMPLEMENTATION, OneHotDenseExperts
from moestream.runtime.offload import OffloadedExperts
from moestream.runtime.publisher import Publisher
from moestream.store.pool import SlotPool
from moestream.topology import ExpertKey
from tests.conftest import SAMPLE_FAMILIES
from tests.runtime.conftest import auto_class

REGISTRY_FAMILIES = [name for name in SAMPLE_FAMILIES if FAMILIES.get(name).uses_experts_registry]
SWAP_FAMILIES = [name for name in SAMPLE_FAMILIES if not FAMILIES.get(name).uses_experts_registry]


def _min_engine(path) -> Engine:
    topology = build_index(path).topology
    budget = f"{topology.top_k * topology.expert_bytes}B"
    return Engine(path, EngineConfig(expert_budget=budget, direct_io=False))


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    index = scores.topk(top_k, dim=-1).indices  # [T, K]
    weights = torch.rand(num_tokens, top_k, generator=generator)  # [T, K]
    return index, weights


def test_the_implementation_is_registered_in_transformers():
    assert IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS


@pytest.mark.parametrize("family", REGISTRY_FAMILIES)
def test_registry_experts_match_the_default_implementation(checkpoint, family):
    """Every expert of the layer is routed, more than the device tier holds: they stream in groups."""
    path = checkpoint(family)
    reference = auto_class(family).from_pretrained(path)
    with _min_engine(path) as engine:
        assert engine.model.config._experts_implementation == IMPLEMENTATION
        topology = engine.checkpoint.topology
        block = engine.checkpoint.blocks[-1]
        hidden = torch.randn(16, reference.config.hidden_size, generator=torch.Generator().manual_seed(1))
        index, weights = _routing(16, topology.num_experts, topology.top_k)
        with torch.no_grad():
            ours = engine.model.get_submodule(block.experts_path)(hidden, index, weights)
            theirs = reference.get_submodule(block.experts_path)(hidden, index, weights)
        assert engine.store.stats().misses == topology.num_experts > engine.store.device_slots
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", SWAP_FAMILIES)
def test_swapped_experts_match_and_skip_dropped_tokens(checkpoint, family):
    path = checkpoint(family)
    reference = auto_class(family).from_pretrained(path)
    with _min_engine(path) as engine:
        block = engine.checkpoint.blocks[0]
        ours = engine.model.get_submodule(block.experts_path)
        assert isinstance(ours, OneHotDenseExperts)
        num_experts = engine.checkpoint.topology.num_experts
        hidden = torch.randn(6, reference.config.d_model, generator=torch.Generator().manual_seed(2))
        chosen = torch.tensor([0, 3, 3, 1, 5, 2]) % num_experts
        selected = torch.nn.functional.one_hot(chosen, num_experts).unsqueeze(1)  # [N, 1, E]
        selected[2] = 0  # token 2 overflowed its expert's capacity: dropped
        weights = torch.rand(6, 1, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            result = ours(hidden, selected, weights)
            expected = reference.get_submodule(block.experts_path)(hidden, selected, weights)
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    assert result[2].abs().max() == 0


class GroupLog:
    """A store that records the groups fetched, forwarding everything to the real store."""

    def __init__(self, store):
        self.store = store
        self.groups = []

    def fetch(self, keys, chosen=()):
        self.groups.append(list(keys))
        return self.store.fetch(keys, chosen)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_resident_experts_run_first_and_misses_stream_in_groups(checkpoint):
    path = checkpoint("mixtral")
    with _min_engine(path) as engine:
        topology = engine.checkpoint.topology
        resident = [ExpertKey(0, 6), ExpertKey(0, 7)]
        engine.store.acquire(resident)
        engine.store.release(resident)
        log = GroupLog(engine.store)
        experts = OffloadedExperts(log, Publisher())
        module = engine.model.get_submodule(engine.checkpoint.blocks[0].experts_path)
        index, weights = _routing(32, topology.num_experts, topology.top_k)
        hidden = torch.randn(32, engine.model.config.hidden_size)
        with torch.no_grad():
            experts.forward(0, FusedExpertMath(module), hidden, index, weights)
    assert log.groups[0] == resident
    assert all(len(group) <= engine.store.device_slots for group in log.groups)
    assert sorted(k.expert for group in log.groups for k in group) == list(range(topology.num_experts))


def test_typed_views_are_kept_for_the_most_recent_slot_addresses_only(checkpoint):
    """Slots move with their experts' file offsets, so a run sees more addresses than slots: the views
    kept stay bounded by the device tier's size."""
    with _min_engine(checkpoint("mixtral")) as engine:
        experts, slots = OffloadedExperts(engine.store, Publisher()), engine.store.device_slots
        pool = SlotPool(3 * slots, engine.checkpoint.topology.expert_bytes)
        for i in range(pool.num_slots):
            slot = pool.slot(i, 64 * i)
            views = experts._slot_views(slot)
            assert all(v.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr() for v in views.values())
        assert len(experts._views) == 2 * slots
        assert experts._slot_views(pool.slot(pool.num_slots - 1, 64 * (pool.num_slots - 1))) is views


def test_an_unbound_experts_module_says_so(checkpoint):
    reference = auto_class("mixtral").from_pretrained(checkpoint("mixtral"))
    reference.set_experts_implementation(IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="not bound"), torch.no_grad():
        reference(torch.tensor([[5, 6, 7]]))
