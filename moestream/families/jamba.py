"""Jamba: which layers attend and which are MoE is set by periods and offsets, not a per-layer list; a
small test model attends in every other layer and routes in the others."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("jamba")
class JambaAdapter(FamilyAdapter):
    model_type = "jamba"
    tiny_fields = dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0)
