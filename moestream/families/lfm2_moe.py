"""LFM2-MoE: a hybrid of short-convolution and attention layers, set by a per-layer list (`layer_types`)
its config leaves None, so a small test model alternates them (conv first, as LFM2); its router adds an
expert_bias (transformers zeroes it, so a test model fills it with noise); the rest is derived."""

from moestream.families import tiny
from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("lfm2_moe")
class Lfm2MoeAdapter(FamilyAdapter):
    noise_init = ("feed_forward.expert_bias",)

    def tiny_config_kwargs(self, sizes: tiny.Sizes) -> dict:
        layer_types = ["full_attention" if i % 2 else "conv" for i in range(sizes.num_layers)]
        return super().tiny_config_kwargs(sizes) | dict(layer_types=layer_types)
