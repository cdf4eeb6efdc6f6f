"""Mixtral: per-expert w1/w3/w2 under `block_sparse_moe` on disk, fused gate_up_proj/down_proj in memory."""

from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter, decoder_kwargs


@FAMILIES.register("mixtral")
class MixtralAdapter(FamilyAdapter):
    model_type = "mixtral"
    parts = (
        ExpertPart("gate_up_proj", ("experts.{expert}.w1.weight", "experts.{expert}.w3.weight")),
        ExpertPart("down_proj", ("experts.{expert}.w2.weight",)),
    )
    num_experts_attr = "num_local_experts"
    layer_disk_prefix = "model.layers.{layer}.block_sparse_moe"
    renames = ((r"\.block_sparse_moe\.", ".mlp."),)

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        return decoder_kwargs(num_layers, hidden_size, vocab_size) | dict(
            intermediate_size=intermediate_size,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
