"""Inkling2-Loop: Inkling2's interleaved expert layout, its releases' experts also in NVFP4/MXFP8."""

from moestream.families.base import FAMILIES, FamilyAdapter
from moestream.families.inkling2 import INTERLEAVED


@FAMILIES.register("inkling2_loop")
class Inkling2LoopAdapter(FamilyAdapter):
    refused = INTERLEAVED + " (and dequantizes NVFP4/MXFP8 experts)"
