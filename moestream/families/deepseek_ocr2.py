"""DeepSeek-OCR-2: a DeepSeek-V2 text decoder behind a SAM + Qwen2 vision tower (never run for text
generation). Its per-layer MoE list (`mlp_layer_types`) is None in the config, so a small test model gets one
dense first layer and MoE after it; the tower's two nested configs, which the generic shrink does not
reach, are made one small layer each."""

from moestream.families import tiny
from moestream.families.base import FAMILIES, FamilyAdapter

SAM = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_dim=64, output_channels=16,
           downsample_channels=[16, 32], global_attn_indexes=[0])
ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, vocab_size=16, layer_types=["full_attention"], max_window_layers=1)


@FAMILIES.register("deepseek_ocr2")
class DeepseekOcr2Adapter(FamilyAdapter):

    def tiny_config_kwargs(self, sizes: tiny.Sizes) -> dict:
        kwargs = super().tiny_config_kwargs(sizes)
        kwargs["text_config"]["mlp_layer_types"] = [
            "dense" if i == 0 and sizes.num_layers > 1 else "sparse" for i in range(sizes.num_layers)]
        vision = kwargs["vision_config"]
        vision |= dict(sam_config=vision["sam_config"] | SAM, encoder_config=vision["encoder_config"] | ENCODER)
        return kwargs
