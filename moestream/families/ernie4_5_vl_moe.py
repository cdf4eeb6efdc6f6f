"""ERNIE 4.5 VL MoE: each MoE layer holds text experts and vision experts (of another width in the
releases) that the checkpoint stores as one expert list (`experts.0..N-1` text, `experts.N..2N-1` vision,
split on load by one converter of both), which the derived layout (one experts module per disk list, expert
e at disk index e) cannot address. Its text model's multimodal rope sections (`mrope_section`, unset in the
config, defaulting to a full-size [22, 22, 20]) are fitted to a small test model's heads of 16."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("ernie4_5_vl_moe")
class Ernie45VLMoeAdapter(FamilyAdapter):
    model_type = "ernie4_5_vl_moe"
    tiny_fields = dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2]))
    refused = ("its text and vision experts are one expert list on disk (vision after text), split on load by a "
               "converter of both, which moestream's expert layout cannot address")
