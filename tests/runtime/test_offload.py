"""The row plan that sorts a layer's (token, k) rows by expert on the device, and routing events built
only for observers that read them."""

import numpy as np
import torch

from moestream.contracts import Observer
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.offload import RowPlan, expert_compute
from moestream.tracer import Tracer, since


def test_rows_are_sorted_by_expert_on_the_device_and_spans_cover_them():
    ids = np.array([5, 2, 2, 7, 5, 0])  # [S] experts of the (token, k) rows, T = 3, K = 2
    used = np.array([True, True, True, True, False, False])  # the last token is padding
    plan = RowPlan(ids, used, torch.from_numpy(ids), num_experts=8)
    assert plan.num_rows == 6 and isinstance(plan.order, torch.Tensor)
    assert plan.order.tolist() == [1, 2, 0, 3]  # expert 2's rows, expert 5's used row, expert 7's row
    assert [plan.span(e) for e in (2, 5, 7)] == [(1 - 1, 2), (2, 3), (3, 4)]
    for expert in (7, 2, 5):
        start, end = plan.span(expert)
        assert (ids[plan.order[start:end].numpy()] == expert).all()


def test_a_layer_without_used_rows_has_an_empty_plan():
    plan = RowPlan(np.array([1, 3]), np.zeros(2, dtype=bool), torch.tensor([1, 3]), num_experts=4)
    assert plan.order.numel() == 0 and plan.num_rows == 2


class LayerReader(Observer):
    def __init__(self):
        self.layers, self.experts = [], []

    def observe(self, event):
        self.layers.append(event.layer)
        self.experts.append(event.expert_ids.ravel().tolist())


def test_routing_events_are_built_only_when_an_observer_reads_them(checkpoint):
    with Engine(checkpoint("mixtral"), EngineConfig(expert_budget="0.5", direct_io=False, policy="lru")) as engine:
        built = []
        publish = engine.publisher.publish
        engine.publisher.publish = lambda layer, *args: built.append(layer) or publish(layer, *args)
        engine.generate([[5, 6, 7]], max_new_tokens=2)
        assert built == []  # LRU and its evictions ignore routing events
        reader = LayerReader()
        engine.add_observer(reader)
        engine.generate([[5, 6, 7]], max_new_tokens=2)
        num_layers = engine.checkpoint.topology.num_layers
    assert built == reader.layers == list(range(num_layers)) * 2


def test_the_tracer_counts_every_routed_expert_mlp(checkpoint):
    tracer = Tracer()
    with Engine(checkpoint("mixtral"), EngineConfig(expert_budget="0.5", direct_io=False, policy="lru"),
                tracer=tracer) as engine:
        reader = LayerReader()
        engine.add_observer(reader)
        before = tracer.totals()
        engine.generate([[5, 6, 7]], max_new_tokens=2)
        experts, seconds = expert_compute(tracer.totals(), before)
    expected = sum(len(set(ids)) for ids in reader.experts)  # each layer runs each expert it routes to once
    assert experts == expected > 0 and seconds > 0
    layers = engine.checkpoint.topology.num_layers * 2  # two forward passes: each layer's weighting and scatter
    assert since(tracer.totals(), before, "layer").spans >= layers
