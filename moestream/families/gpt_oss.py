"""GPT-OSS: experts stored fused over experts on disk and in memory ([E, H, 2I] gate_up_proj with
interleaved gate/up columns, [E, I, H] down_proj, and per-expert biases); a `router` with a bias.
"""

from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter


@FAMILIES.register("gpt_oss")
class GptOssAdapter(FamilyAdapter):
    model_type = "gpt_oss"
    parts = (
        ExpertPart("gate_up_proj", ("experts.gate_up_proj",), fused_on_disk=True),
        ExpertPart("gate_up_proj_bias", ("experts.gate_up_proj_bias",), fused_on_disk=True),
        ExpertPart("down_proj", ("experts.down_proj",), fused_on_disk=True),
        ExpertPart("down_proj_bias", ("experts.down_proj_bias",), fused_on_disk=True),
    )
    num_experts_attr = "num_local_experts"
    noise_init = ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "mlp.router.bias")

    def tiny_config_kwargs(self, *sizes):
        return super().tiny_config_kwargs(*sizes) | dict(
            head_dim=16,
            sliding_window=16,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_max_position_embeddings=128),
        )
