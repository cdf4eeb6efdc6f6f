"""Qwen3-Omni MoE: the thinker generates the text; the talker is left out of a small test model
(`enable_audio_output=False`, as the Thinking release). The thinker's config class lacks the vision-start
token id its multimodal positions read (the releases' config.json carry it); its audio tower and the vision
tower's deepstack taps are shrunk to one small layer."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("qwen3_omni_moe")
class Qwen3OmniMoeAdapter(FamilyAdapter):

    def tiny_config_kwargs(self, sizes):
        kwargs = super().tiny_config_kwargs(sizes)
        thinker = kwargs["thinker_config"]
        thinker["vision_start_token_id"] = 151652
        thinker["audio_config"] |= dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                                        downsample_hidden_size=16, output_dim=sizes.hidden_size)
        thinker["vision_config"] |= dict(deepstack_visual_indexes=[0])
        return kwargs | dict(enable_audio_output=False)
