"""DeepSeek-V3: DeepSeek-V2's layout, with sigmoid router scores and an e_score_correction_bias,
group-limited top-k (groups scored by their top-2) and a routed_scaling_factor.
"""

from moestream.families.base import FAMILIES
from moestream.families.deepseek_v2 import DeepseekV2Adapter, expert_groups


@FAMILIES.register("deepseek_v3")
class DeepseekV3Adapter(DeepseekV2Adapter):
    model_type = "deepseek_v3"
    noise_init = ("mlp.gate.e_score_correction_bias",)

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        n_group, topk_group = expert_groups(num_experts, top_k, min_group_size=2)
        return self.mla_kwargs(num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size) | dict(
            n_shared_experts=1, q_lora_rank=max(16, hidden_size // 2), n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=2.5, norm_topk_prob=True)
