"""Mixtral: per-expert w1/w3/w2 under `block_sparse_moe` on disk, fused gate_up_proj/down_proj in memory."""

from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter


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
