"""Granite 4 (MoE hybrid): which layers attend is a per-layer list the config defaults to all-Mamba; a
small test model makes its last layer attend (as the releases mix attention into Mamba layers)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("granitemoehybrid")
class GraniteMoeHybridAdapter(FamilyAdapter):

    def tiny_config_kwargs(self, sizes):
        kinds = ["linear_attention"] * (sizes.num_layers - 1) + ["full_attention"]
        return super().tiny_config_kwargs(sizes) | dict(layer_types=kinds)
