"""DeepSeek-V3: sigmoid router scores with an e_score_correction_bias (transformers zeroes it, so a test
model fills it with noise), a routed_scaling_factor, and FP8 block releases."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("deepseek_v3")
class DeepseekV3Adapter(FamilyAdapter):
    noise_init = ("mlp.gate.e_score_correction_bias",)
    tiny_fields = dict(n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    quant_formats = ("fp8",)
