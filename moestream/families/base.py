"""What a model family declares: where its MoE blocks live, how an expert is laid out in a slot and
on disk, and its routing specifics. One adapter per file; the engine and the store read these
declarations and know no family by name.

Slot layout: an expert's slot is the concatenation, in `parts` order, of the per-expert slices of the
experts module's fused parameters (e.g. gate_up_proj[e] then down_proj[e]), each in the checkpoint's
dtype. On disk, a part is filled by the listed tensors in order (e.g. w1 then w3 fill gate_up_proj[e]),
each a contiguous byte range of a safetensors file, or slice [e] of a tensor fused over experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from moestream.registry import Registry
from moestream.topology import Topology


@dataclass(frozen=True)
class ExpertPart:
    param: str  # fused parameter of the experts module in memory, e.g. "gate_up_proj"
    disk: tuple[str, ...]  # disk tensor names, relative to the block prefix, with {expert}
    fused_on_disk: bool = False  # the disk tensor is [E, ...] for all experts; take [expert]


@dataclass(frozen=True)
class MoEBlock:
    moe_index: int  # 0..L-1
    layer_id: int  # decoder-layer index (for encoder-decoder models, a running block index)
    disk_prefix: str  # e.g. "model.layers.3.block_sparse_moe"
    experts_path: str  # module path of the experts module in the model, e.g. "model.layers.3.mlp.experts"


class FamilyAdapter:
    """Base adapter. Subclasses set the class attributes and override only what differs."""

    model_type: ClassVar[str]
    auto_class: ClassVar[str] = "AutoModelForCausalLM"
    parts: ClassVar[tuple[ExpertPart, ...]]
    num_experts_attr: ClassVar[str] = "num_experts"
    top_k_attr: ClassVar[str] = "num_experts_per_tok"
    layer_disk_prefix: ClassVar[str] = "model.layers.{layer}.mlp"
    layer_experts_path: ClassVar[str] = "model.layers.{layer}.mlp.experts"
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()  # regex renames from disk keys to model keys
    uses_experts_registry: ClassVar[bool] = True  # False: the engine swaps the experts module
    fixed_top_k: ClassVar[int | None] = None  # the family's router only supports this top-k
    noise_init: ClassVar[tuple[str, ...]] = ()  # name suffixes of tensors a test model fills with noise

    def model_key(self, disk_key: str) -> str:
        """The model's parameter name for a dense tensor stored on disk as `disk_key`."""
        for pattern, replacement in self.renames:
            disk_key = re.sub(pattern, replacement, disk_key)
        return disk_key

    def expert_tensor(self, experts_module, expert: int, param: str):
        """The in-memory tensor of `param` for one expert (what a slot view of `param` must equal)."""
        return getattr(experts_module, param)[expert]

    def num_experts(self, config) -> int:
        return int(getattr(config, self.num_experts_attr))

    def top_k(self, config) -> int:
        if self.fixed_top_k is not None:
            return self.fixed_top_k
        return int(getattr(config, self.top_k_attr))

    def num_shared_experts(self, config) -> int:
        return 0

    def moe_layer_ids(self, config) -> list[int]:
        return list(range(config.num_hidden_layers))

    def blocks(self, config) -> list[MoEBlock]:
        return [
            MoEBlock(i, layer, self.layer_disk_prefix.format(layer=layer), self.layer_experts_path.format(layer=layer))
            for i, layer in enumerate(self.moe_layer_ids(config))
        ]

    def topology(self, config, expert_bytes: int) -> Topology:
        return Topology(
            moe_layer_ids=tuple(self.moe_layer_ids(config)),
            num_experts=self.num_experts(config),
            top_k=self.top_k(config),
            expert_bytes=expert_bytes,
            num_shared_experts=self.num_shared_experts(config),
        )

    def tiny_config_kwargs(self, num_layers: int, num_experts: int, top_k: int, hidden_size: int,
                           intermediate_size: int, vocab_size: int) -> dict:
        """Config fields for `moestream make-model` (passed to AutoConfig.for_model); by default a small
        decoder (`decoder_kwargs`) with experts intermediate_size wide."""
        return decoder_kwargs(num_layers, hidden_size, vocab_size) | {
            "intermediate_size": intermediate_size, self.num_experts_attr: num_experts, self.top_k_attr: top_k}


def decoder_kwargs(num_layers: int, hidden_size: int, vocab_size: int) -> dict:
    """Common config fields of a small decoder-only test model: 16-wide heads, grouped KV heads. The
    weights keep transformers' init (std 0.02): larger weights make hidden states of different tokens
    alike, so routing concentrates on few experts."""
    num_heads = max(1, hidden_size // 16)
    return dict(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2 if num_heads % 2 == 0 else num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


FAMILIES: Registry[FamilyAdapter] = Registry("model family")
