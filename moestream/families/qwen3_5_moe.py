"""Qwen3.5 / 3.6 MoE: its layout is derived; published in Qwen3.5's FP8 block release (each expert's
linears apart, the vision tower, the linear-attention in_proj_a / in_proj_b and the shared-expert gate in BF16)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("qwen3_5_moe")
class Qwen3_5MoeAdapter(FamilyAdapter):
    quant_formats = ("fp8",)
