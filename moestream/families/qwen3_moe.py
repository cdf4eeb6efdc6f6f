"""Qwen3-MoE: Qwen2-MoE's expert layout without a shared expert; top-k weights renormalized."""

from moestream.families.base import FAMILIES, FamilyAdapter
from moestream.families.qwen2_moe import QWEN_PARTS, sparse_layer_ids


@FAMILIES.register("qwen3_moe")
class Qwen3MoeAdapter(FamilyAdapter):
    model_type = "qwen3_moe"
    parts = QWEN_PARTS

    def moe_layer_ids(self, config) -> list[int]:
        return sparse_layer_ids(config)

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        return super().tiny_config_kwargs(num_layers, num_experts, top_k, hidden_size, 2 * intermediate_size,
                                          vocab_size) | dict(moe_intermediate_size=intermediate_size,
                                                             norm_topk_prob=True)
