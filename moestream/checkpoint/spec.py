"""What `moestream make-model` writes: a validated ModelSpec, and the demo checkpoint's settings.

Light to import (no torch or transformers), so the CLI can build its parser quickly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moestream.errors import CheckpointError
from moestream.families import FAMILIES, FamilyAdapter

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")  # token ids 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 16  # every byte, the specials, a few merges
DTYPE_NAMES = ("bf16", "fp32")
DEFAULT_TOP_K = 2


@dataclass(frozen=True)
class ModelSpec:
    """What `moestream make-model` writes. `top_k=None` takes the family's (fixed) default."""

    family: str
    num_layers: int = 4
    num_experts: int = 8
    top_k: int | None = None
    hidden_size: int = 64
    intermediate_size: int = 64
    vocab_size: int = 512
    seed: int = 0
    dtype: str = "fp32"
    max_shard_bytes: int | None = None
    config_overrides: dict = field(default_factory=dict)  # extra config fields, applied last

    def __post_init__(self):
        adapter = self.adapter()
        fixed = adapter.fixed_top_k
        if self.top_k is not None and fixed is not None and self.top_k != fixed:
            raise CheckpointError(
                f"family {self.family} routes each token to exactly {fixed} expert(s), not {self.top_k}")
        if self.num_layers < 1 or self.num_experts < 1 or self.intermediate_size < 1:
            raise CheckpointError("num_layers, num_experts and intermediate_size must be >= 1")
        if not 1 <= self.resolved_top_k <= self.num_experts:
            raise CheckpointError(f"top-k {self.resolved_top_k} must be between 1 and num_experts ({self.num_experts})")
        if self.hidden_size < 16 or self.hidden_size % 16:
            raise CheckpointError(f"hidden size {self.hidden_size} must be a positive multiple of 16")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise CheckpointError(f"vocab size {self.vocab_size} is too small for a byte-level tokenizer "
                                  f"(need >= {MIN_VOCAB_SIZE})")
        if self.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        if self.max_shard_bytes is not None and self.max_shard_bytes < 1:
            raise CheckpointError(f"max shard bytes must be >= 1, got {self.max_shard_bytes}")

    def adapter(self) -> FamilyAdapter:
        if self.family not in FAMILIES:
            raise CheckpointError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES.names())}")
        return FAMILIES.create(self.family)

    @property
    def resolved_top_k(self) -> int:
        fixed = self.adapter().fixed_top_k
        return self.top_k if self.top_k is not None else (fixed if fixed is not None else DEFAULT_TOP_K)


def demo_spec() -> ModelSpec:
    """DeepSeek-V2-Lite's topology (27 layers, layer 0 dense; 26 MoE layers of 64 routed experts, top-6,
    2 shared experts, greedy softmax routing) at reduced width: about 1.07 GiB of bf16 routed experts."""
    return ModelSpec(
        family="deepseek_v2",
        num_layers=27,
        num_experts=64,
        top_k=6,
        hidden_size=256,
        intermediate_size=448,
        vocab_size=1024,
        dtype="bf16",
        max_shard_bytes=256 * 2**20,
        config_overrides=dict(n_shared_experts=2, topk_method="greedy", n_group=1, topk_group=1),
    )
