"""Inkling2: releases store each expert's gate and up rows interleaved (`w13_weight`), which transformers
reorders on load; a slot holds disk bytes as they are, so the layout cannot be read in place."""

from moestream.families.base import FAMILIES, FamilyAdapter

INTERLEAVED = ("its releases interleave each expert's gate and up rows (w13_weight), which transformers "
               "reorders on load; moestream reads expert bytes in place")


@FAMILIES.register("inkling2")
class Inkling2Adapter(FamilyAdapter):
    refused = INTERLEAVED

