"""DeepSeek-V3: sigmoid router scores with an e_score_correction_bias, group-limited top-k (groups
scored by their top-2), routed_scaling_factor, shared experts kept dense, first layers dense.
"""

from moestream.families.base import FAMILIES, FamilyAdapter
from moestream.families.deepseek_v2 import expert_groups, mla_kwargs
from moestream.families.qwen2_moe import QWEN_PARTS


@FAMILIES.register("deepseek_v3")
class DeepseekV3Adapter(FamilyAdapter):
    model_type = "deepseek_v3"
    parts = QWEN_PARTS
    num_experts_attr = "n_routed_experts"
    noise_init = ("mlp.gate.e_score_correction_bias",)

    def num_shared_experts(self, config) -> int:
        return int(config.n_shared_experts or 0)

    def moe_layer_ids(self, config) -> list[int]:
        return list(range(config.first_k_dense_replace, config.num_hidden_layers))

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        n_group, topk_group = expert_groups(num_experts, top_k, min_group_size=2)
        return mla_kwargs(num_layers, hidden_size, vocab_size) | dict(
            intermediate_size=4 * intermediate_size,
            moe_intermediate_size=intermediate_size,
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=max(16, hidden_size // 2),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
