"""Qwen3-MoE: top-k weights renormalized in its releases; published in FP8 block and GPTQ 4-bit."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("qwen3_moe")
class Qwen3MoeAdapter(FamilyAdapter):
    tiny_fields = dict(norm_topk_prob=True)
    quant_formats = ("fp8", "w4a16")
