"""DeepSeek-V3.2: its layout is derived; published in DeepSeek-V3.2's FP8 block release (the sparse-attention
indexer's wq_b and wk in FP8 too, its weights_proj in BF16)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("deepseek_v32")
class DeepseekV32Adapter(FamilyAdapter):
    quant_formats = ("fp8",)
