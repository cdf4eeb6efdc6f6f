"""PhiMoE: Mixtral's disk layout, a `router` (not `gate`) in memory, and sparsemixer top-2 routing."""

from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter, decoder_kwargs


@FAMILIES.register("phimoe")
class PhimoeAdapter(FamilyAdapter):
    model_type = "phimoe"
    parts = (
        ExpertPart("gate_up_proj", ("experts.{expert}.w1.weight", "experts.{expert}.w3.weight")),
        ExpertPart("down_proj", ("experts.{expert}.w2.weight",)),
    )
    num_experts_attr = "num_local_experts"
    layer_disk_prefix = "model.layers.{layer}.block_sparse_moe"
    renames = ((r"\.block_sparse_moe\.", ".mlp."), (r"\.mlp\.gate\.weight$", ".mlp.router.weight"))
    fixed_top_k = 2

    def tiny_config_kwargs(self, num_layers, num_experts, top_k, hidden_size, intermediate_size, vocab_size):
        return decoder_kwargs(num_layers, hidden_size, vocab_size) | dict(
            intermediate_size=intermediate_size,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
