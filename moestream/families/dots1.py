"""dots.llm1: sigmoid router scores with an e_score_correction_bias (transformers zeroes it, so a test
model fills it with noise); its config leaves the shared-expert count None, so a small test model has
two shared experts (as dots.llm1) and normalised, scaled top-k weights; the rest is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("dots1")
class Dots1Adapter(FamilyAdapter):
    noise_init = ("mlp.gate.e_score_correction_bias",)
    tiny_fields = dict(n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
