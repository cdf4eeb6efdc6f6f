"""GLM-5 (DeepSeek sparse attention): its layout is derived; published in GLM-5's FP8 block release (the
indexer's weights_proj in BF16)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("glm_moe_dsa")
class GlmMoeDsaAdapter(FamilyAdapter):
    quant_formats = ("fp8",)
