"""OLMoE: Qwen-style per-expert gate/up/down_proj on disk, every decoder layer sparse, no shared expert."""

from moestream.families.base import FAMILIES, FamilyAdapter, decoder_kwargs
from moestream.families.qwen2_moe import QWEN_PARTS


@FAMILIES.register("olmoe")
class OlmoeAdapter(FamilyAdapter):
    model_type = "olmoe"
    parts = QWEN_PARTS

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        return decoder_kwargs(num_layers, hidden_size, vocab_size) | dict(
            intermediate_size=intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
        )
