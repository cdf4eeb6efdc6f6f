"""Qwen3-Next: its layout is derived; published in Qwen3-Next-80B-A3B's FP8 block release (the
linear-attention in_proj_ba and the shared-expert gate in BF16)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("qwen3_next")
class Qwen3NextAdapter(FamilyAdapter):
    quant_formats = ("fp8",)
