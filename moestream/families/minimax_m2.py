"""MiniMax-M2: its layout is derived; released in FP8 block (MiniMax-M2's own weights: attention and each
expert's w1 / w2 / w3 in FP8, the router in float32)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("minimax_m2")
class MiniMaxM2Adapter(FamilyAdapter):
    quant_formats = ("fp8",)
