"""OLMoE: Qwen-style per-expert gate/up/down_proj on disk, every decoder layer sparse, no shared expert."""

from moestream.families.base import FAMILIES, FamilyAdapter
from moestream.families.qwen2_moe import QWEN_PARTS


@FAMILIES.register("olmoe")
class OlmoeAdapter(FamilyAdapter):
    model_type = "olmoe"
    parts = QWEN_PARTS
