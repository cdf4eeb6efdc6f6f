"""GPT-OSS: per-expert biases and a router bias (transformers zeroes them, so a test model fills them with
noise), sliding-window layers with YaRN rope, and MXFP4 releases; its layout is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("gpt_oss")
class GptOssAdapter(FamilyAdapter):
    noise_init = ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "mlp.router.bias")
    tiny_fields = dict(sliding_window=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=128))
    quant_formats = ("mxfp4",)
