"""ERNIE 4.5 VL MoE: each MoE layer holds text experts and vision experts that the checkpoint stores as one
expert list (text, then vision), split on load by one converter of both, which the derived layout cannot
address. Its text model's multimodal rope sections (`mrope_section`, defaulting to a full-size [22, 22, 20])
are fitted to a small test model's heads of 16."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("ernie4_5_vl_moe")
class Ernie45VLMoeAdapter(FamilyAdapter):
    tiny_fields = dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2]))
    refused = ("its text and vision experts are one expert list on disk (vision after text), split on load by a "
               "converter of both, which moestream's expert layout cannot address")
