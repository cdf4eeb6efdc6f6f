"""Qwen2-MoE: per-expert gate/up/down_proj on disk, plus a sigmoid-gated shared expert kept dense."""

from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter

QWEN_PARTS = (
    ExpertPart("gate_up_proj", ("experts.{expert}.gate_proj.weight", "experts.{expert}.up_proj.weight")),
    ExpertPart("down_proj", ("experts.{expert}.down_proj.weight",)),
)


def sparse_layer_ids(config) -> list[int]:
    """Decoder layers with a sparse MoE block in Qwen-style configs."""
    step = config.decoder_sparse_step
    return [
        layer
        for layer in range(config.num_hidden_layers)
        if layer not in config.mlp_only_layers and config.num_experts > 0 and (layer + 1) % step == 0
    ]


@FAMILIES.register("qwen2_moe")
class Qwen2MoeAdapter(FamilyAdapter):
    model_type = "qwen2_moe"
    parts = QWEN_PARTS

    def num_shared_experts(self, config) -> int:
        return 1 if config.shared_expert_intermediate_size > 0 else 0

    def moe_layer_ids(self, config) -> list[int]:
        return sparse_layer_ids(config)

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        return super().tiny_config_kwargs(num_layers, num_experts, top_k, hidden_size, 2 * intermediate_size,
                                          vocab_size) | dict(moe_intermediate_size=intermediate_size,
                                                             shared_expert_intermediate_size=2 * intermediate_size)
