"""DeepSeek-V2: first_k_dense_replace dense layers, routed experts with group-limited greedy routing,
and shared experts kept with the dense part. Disk layout is Qwen-style per-expert gate/up/down_proj.
"""

import math

from moestream.families.base import FAMILIES, FamilyAdapter
from moestream.families.qwen2_moe import QWEN_PARTS


def expert_groups(num_experts: int, top_k: int, min_group_size: int) -> tuple[int, int]:
    """(n_group, topk_group) that make group-limited routing bite for these sizes; (1, 1) if none fits."""
    for n_group in (4, 2):
        size = num_experts // n_group
        if num_experts % n_group == 0 and size >= min_group_size:
            return n_group, min(n_group, max(math.ceil(top_k / size), n_group // 2))
    return 1, 1


@FAMILIES.register("deepseek_v2")
class DeepseekV2Adapter(FamilyAdapter):
    model_type = "deepseek_v2"
    parts = QWEN_PARTS
    num_experts_attr = "n_routed_experts"

    def num_shared_experts(self, config) -> int:
        return int(config.n_shared_experts or 0)

    def moe_layer_ids(self, config) -> list[int]:
        return list(range(config.first_k_dense_replace, config.num_hidden_layers))

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        n_group, topk_group = expert_groups(num_experts, top_k, min_group_size=top_k)
        return self.mla_kwargs(num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size) | dict(
            n_shared_experts=2, q_lora_rank=None, topk_method="group_limited_greedy" if n_group > 1 else "greedy",
            n_group=n_group, topk_group=topk_group)

    def mla_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size) -> dict:
        """The decoder's fields with one dense first layer 4 x intermediate_size wide, plus small multi-head
        latent attention dimensions."""
        base = super().tiny_config_kwargs(num_layers, num_experts, top_k, hidden_size, 4 * intermediate_size,
                                          vocab_size)
        return base | dict(num_key_value_heads=base["num_attention_heads"], kv_lora_rank=max(16, hidden_size // 4),
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           moe_intermediate_size=intermediate_size, first_k_dense_replace=1)
