"""Seeded synthetic routing traces with the structure real routing has (skewed popularity,
inter-layer and inter-token locality, token-id affinity), and named model shapes to make them for
(`synthetic:deepseek-v3` where `moestream sim` takes a trace), when no real trace of that shape
exists. Real results use real traces; this module knows no policy and no simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moestream.errors import MoestreamError
from moestream.topology import Topology
from moestream.trace.schema import Trace

SYNTHETIC_PREFIX = "synthetic:"


@dataclass(frozen=True)
class ModelShape:
    topology: Topology
    hidden_bytes: int  # one token's hidden state in bf16 (2 x hidden size)
    source: str


SHAPES: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(
        # 61 decoder layers, the first 3 dense; experts 3 x 7168 x 2048 params in FP8 (the checkpoint's)
        Topology(moe_layer_ids=tuple(range(3, 61)), num_experts=256, top_k=8, expert_bytes=3 * 7168 * 2048,
                 num_shared_experts=1),
        hidden_bytes=2 * 7168,
        source="DeepSeek-V3 config.json: hidden 7168, moe_intermediate 2048, 256 routed + 1 shared, top-8",
    ),
}


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


def shape_of(spec: str) -> ModelShape:
    """The shape a `synthetic:NAME` trace names."""
    name = spec.removeprefix(SYNTHETIC_PREFIX)
    if name not in SHAPES:
        raise MoestreamError(f"unknown synthetic model shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    return SHAPES[name]


def synthetic_shape_trace(spec: str, num_sequences: int = 16, tokens_per_sequence: int = 64, seed: int = 0) -> Trace:
    """A synthetic trace of the shape `synthetic:NAME` names: num_sequences sequences of tokens_per_sequence."""
    trace = synthetic_trace(shape_of(spec).topology, num_sequences, tokens_per_sequence, seed=seed)
    trace.source = f"{spec}(seed={seed})"
    return trace
