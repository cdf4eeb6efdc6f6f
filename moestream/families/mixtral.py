"""Mixtral: published in GPTQ 4-bit; its layout is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("mixtral")
class MixtralAdapter(FamilyAdapter):
    quant_formats = ("w4a16",)
