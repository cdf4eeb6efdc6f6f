"""A layer's output is bit-identical whatever the order its experts' bytes arrive in.

With top_k >= 4 a token's expert outputs are summed over four or more terms, where floating-point
addition no longer commutes exactly: summing them in arrival order would change the result."""

import torch

from moestream.checkpoint.index import build_index
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.expert_math import FusedExpertMath
from moestream.runtime.offload import OffloadedExperts
from moestream.runtime.publisher import Publisher
from moestream.store.fetch import Fetch


class ForcedArrival:
    """The engine's store, handing a fetch's experts out last-asked first (or first-asked first)."""

    def __init__(self, store, reverse: bool):
        self.store, self.reverse = store, reverse
        self.handed: list = []

    def fetch(self, keys, chosen=()):
        self.store.fetch(keys, chosen)
        return Fetch(self, list(keys))

    def next_ready(self, candidates):
        key, slot = self.store.next_ready([candidates[-1] if self.reverse else candidates[0]])
        self.handed.append(key)
        return key, slot

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_layer_is_bit_identical_whatever_the_order_its_experts_arrive_in(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", num_layers=2, num_experts=8, top_k=4)
    topology = build_index(path).topology
    assert topology.top_k >= 4
    config = EngineConfig(expert_budget=topology.num_experts * topology.expert_bytes, direct_io=False)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(24, 64, generator=generator)  # [T, H]
    index = torch.rand(24, topology.num_experts, generator=generator).topk(topology.top_k, dim=-1).indices  # [T, K]
    weights = torch.rand(24, topology.top_k, generator=generator)  # [T, K]
    outputs, orders = {}, {}
    with Engine(path, config) as engine, torch.no_grad():
        module = engine.model.get_submodule(engine.checkpoint.blocks[0].experts_path)
        for reverse in (False, True):
            store = ForcedArrival(engine.store, reverse)
            experts = OffloadedExperts(store, Publisher())
            outputs[reverse] = experts.forward(0, FusedExpertMath(module), hidden, index, weights)  # [T, H]
            orders[reverse] = store.handed
    assert orders[True] == orders[False][::-1] and len(orders[True]) == topology.num_experts
    assert torch.equal(outputs[True], outputs[False])
