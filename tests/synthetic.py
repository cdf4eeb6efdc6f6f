"""Seeded synthetic traces with the structure real routing has (skewed popularity, inter-layer and
inter-token locality, token-id affinity), for tests. Real results use real traces."""

from __future__ import annotations

import numpy as np

from moestream.topology import Topology
from moestream.trace.schema import Trace


def synthetic_trace(
    topology: Topology,
    num_sequences: int = 8,
    tokens_per_sequence: int = 24,
    vocab_size: int = 50,
    seed: int = 0,
) -> Trace:
    rng = np.random.default_rng(seed)
    num_layers, num_experts, k = topology.num_layers, topology.num_experts, topology.top_k
    popularity = rng.dirichlet(np.full(num_experts, 0.5), size=num_layers)  # [L, E]
    token_affinity = rng.dirichlet(np.full(num_experts, 0.3), size=(vocab_size, num_layers))  # [V, L, E]
    n = num_sequences * tokens_per_sequence
    token_ids = rng.integers(0, vocab_size, size=n)
    experts = np.empty((n, num_layers, k), dtype=np.int16)
    for row, token in enumerate(token_ids):
        for layer in range(num_layers):
            p = 0.5 * token_affinity[token, layer] + 0.5 * popularity[layer]
            experts[row, layer] = rng.choice(num_experts, size=k, replace=False, p=p)
    positions = np.tile(np.arange(tokens_per_sequence), num_sequences)
    return Trace(
        topology=topology,
        experts=experts,
        seq_ids=np.repeat(np.arange(num_sequences), tokens_per_sequence).astype(np.int32),
        positions=positions.astype(np.int32),
        is_prefill=positions < tokens_per_sequence // 2,
        token_ids=token_ids.astype(np.int32),
        tokens=[f"t{t}" for t in token_ids],
        source=f"synthetic(seed={seed})",
    )
