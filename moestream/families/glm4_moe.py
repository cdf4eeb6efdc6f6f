"""GLM-4.5 / 4.6 / 4.7: its layout is derived; published in GLM-4.5's FP8 block release (and 4.6's, 4.7's)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("glm4_moe")
class Glm4MoeAdapter(FamilyAdapter):
    quant_formats = ("fp8",)
