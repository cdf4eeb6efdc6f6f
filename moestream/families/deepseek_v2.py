"""DeepSeek-V2: a small test model routes with group-limited greedy top-k and has no query LoRA (as
DeepSeek-V2-Lite); the rest is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("deepseek_v2")
class DeepseekV2Adapter(FamilyAdapter):
    tiny_fields = dict(q_lora_rank=None, topk_method="group_limited_greedy")
