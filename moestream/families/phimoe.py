"""PhiMoE: Mixtral's disk layout, a `router` (not `gate`) in memory, and sparsemixer top-2 routing."""

from moestream.families.base import FAMILIES
from moestream.families.mixtral import MixtralAdapter


@FAMILIES.register("phimoe")
class PhimoeAdapter(MixtralAdapter):
    model_type = "phimoe"
    renames = MixtralAdapter.renames + ((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),)
    fixed_top_k = 2
