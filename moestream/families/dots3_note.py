"""dots3-note: a multi-head-latent-attention text decoder whose sliding-window layers are wider than its
sparse-attention ones (`per_layer_config`: more heads, wider latents, head_dim = qk_nope + qk_rope), with
vision and audio towers. A small test model keeps that (its sliding-window overrides small but unlike the
other layers'); its window and the indexer's budget (8 tokens each) are shorter than the longer test prompts,
so that both bite; the towers' adapters join at the small widths. Its router's e_score_correction_bias
(zeroed by transformers) is filled with noise. The small vision tower's one layer is dense (only the text
decoder's experts are offloaded)."""

from moestream.families import tiny
from moestream.families.base import FAMILIES, FamilyAdapter

SLIDING = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=24,
               head_dim=32)  # head_dim = qk_nope_head_dim + the shrunk qk_rope_head_dim (8)


@FAMILIES.register("dots3_note")
class Dots3NoteAdapter(FamilyAdapter):
    noise_init = ("mlp.gate.e_score_correction_bias",)
    tiny_fields = dict(index_topk=8, sliding_window=8)

    def tiny_config_kwargs(self, sizes: tiny.Sizes) -> dict:
        kwargs = super().tiny_config_kwargs(sizes)
        text, vision, audio = kwargs["text_config"], kwargs["vision_config"], kwargs["audio_config"]
        text["per_layer_config"] = {layer: SLIDING for layer, kind in enumerate(text["layer_types"])
                                    if kind == "sliding_attention"}
        vision |= dict(adapter_in_dim=vision["hidden_size"], adapter_out_dim=sizes.hidden_size,
                       mlp_layer_types=["dense"], per_layer_config={})  # its one layer dense
        audio |= dict(adapter_input_size=audio["hidden_size"], adapter_out_dim=sizes.hidden_size,
                      downsample_hidden_size=16)  # its convolution stem's width (480)
        return kwargs
