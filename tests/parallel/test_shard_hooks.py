"""The engine's hooks for expert parallelism, on one process with a shard that owns the even experts:
a rank fetches, prefetches and preloads only what it owns, whatever the policy plans, and each layer's
rows go through the shard's combine."""

import numpy as np
import pytest

from moestream.config import EngineConfig
from moestream.contracts import Policy, Prediction, Predictor
from moestream.runtime import Engine
from moestream.topology import ExpertKey


class EvenExperts:
    """Owns the even experts; its combine hands back this process's rows (there is no other rank)."""

    def __init__(self):
        self.layers: list[int] = []

    def owns(self, key: ExpertKey) -> bool:
        return key.expert % 2 == 0

    def owned_rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        return ids % 2 == 0

    def combine(self, layer: int, out):
        self.layers.append(layer)
        return out


class NextLayerWhole(Predictor):
    """Predicts every expert of the next layer, owned here or not (the policy sees the whole routing)."""

    def __init__(self, topology):
        self.topology = topology

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        layer = (layer_now + 1) % self.topology.num_layers
        return [Prediction(layer, e, 1.0) for e in range(self.topology.num_experts)]


class PrefetchesEverything(Policy):
    def make_predictor(self) -> Predictor:
        return NextLayerWhole(self.topology)


@pytest.mark.parametrize("sync", [False, True])
def test_a_rank_reads_and_holds_only_the_experts_it_owns(tiny_checkpoint, sync):
    shard, model = EvenExperts(), tiny_checkpoint("mixtral")
    with Engine(model, EngineConfig(expert_budget=0.25, sync=sync), shard=shard,
                policy=PrefetchesEverything(Engine(model).checkpoint.topology)) as engine:
        engine.generate([[5, 6, 7, 8], [9, 10]], max_new_tokens=6)
        held = engine.store.resident() | engine.store.in_flight()
        owned = set(engine.owned_keys())
    assert held and held <= owned
    assert owned == {key for key in engine.checkpoint.topology.keys() if key.expert % 2 == 0}
    assert len(shard.layers) == 6 * engine.checkpoint.topology.num_layers  # every layer of every step


def test_a_rank_preloads_its_experts_when_its_budget_holds_them(tiny_checkpoint):
    with Engine(tiny_checkpoint("mixtral"), EngineConfig(expert_budget=0.5), shard=EvenExperts()) as engine:
        assert engine.store.resident() == set(engine.owned_keys())
