"""Mixtral: published in GPTQ 4-bit; its layout is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("mixtral")
class MixtralAdapter(FamilyAdapter):
    model_type = "mixtral"
    quant_formats = ("w4a16",)
