"""Hunyuan-V4-VL: sigmoid router scores with an e_score_correction_bias (transformers zeroes it, so a test
model fills it with noise); a small test model's sparse-attention indexer keeps 8 tokens, fewer than the
longer test prompts hold, so that selection bites. The rest is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("hy_v4_vl")
class HyV4VlAdapter(FamilyAdapter):
    noise_init = ("mlp.gate.e_score_correction_bias",)
    tiny_fields = dict(index_topk=8)
