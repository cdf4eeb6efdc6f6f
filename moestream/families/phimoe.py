"""PhiMoE: sparsemixer routing, which only supports top-2."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("phimoe")
class PhimoeAdapter(FamilyAdapter):
    fixed_top_k = 2
