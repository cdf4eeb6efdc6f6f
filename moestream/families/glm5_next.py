"""GLM-5.3-Flash (glm5_next): its sparse-attention (DSA) layers use no rotary embedding (qk_rope_head_dim 0,
which the config requires and the generic shrink would widen); its router's e_score_correction_bias (zeroed
by transformers) is filled with noise. A small test model: one dense first layer, MoE after it; the indexer
keeps 2 pools of 2 tokens, fewer than the longer test prompts hold; the vision merger is shrunk too."""

from moestream.families import tiny
from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("glm5_next")
class Glm5NextAdapter(FamilyAdapter):
    noise_init = ("mlp.gate.e_score_correction_bias",)
    tiny_fields = dict(qk_rope_head_dim=0, index_topk=4, index_kpool=2)

    def tiny_config_kwargs(self, sizes: tiny.Sizes) -> dict:
        kwargs = super().tiny_config_kwargs(sizes)
        kwargs["text_config"]["mlp_layer_types"] = [
            "dense" if i == 0 and sizes.num_layers > 1 else "sparse" for i in range(sizes.num_layers)]
        kwargs["vision_config"]["projection_intermediate_size"] = 2 * sizes.hidden_size
        return kwargs
