"""A topology's routing shape: what replay, the simulator and saved predictors must share."""

import dataclasses

from moestream.topology import Topology

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2, expert_bytes=1024)


def test_routing_ignores_layer_ids_and_expert_sizes_only():
    assert TOPOLOGY.routes_like(dataclasses.replace(TOPOLOGY, moe_layer_ids=(0, 1, 2), expert_bytes=64))
    for other in (dataclasses.replace(TOPOLOGY, moe_layer_ids=(1, 2)), dataclasses.replace(TOPOLOGY, num_experts=16),
                  dataclasses.replace(TOPOLOGY, top_k=1)):
        assert not TOPOLOGY.routes_like(other)
    assert TOPOLOGY.routing_shape() == "3 MoE layers x 8 experts, top-2"
