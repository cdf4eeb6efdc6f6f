"""Mistral 4: multi-head latent attention whose YaRN rope names its width as a fraction of head_dim
(`partial_rotary_factor`); a small test model, whose head_dim is the rope's width (as for every latent
attention family), rotates all of it."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("mistral4")
class Mistral4Adapter(FamilyAdapter):
    tiny_fields = dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=128, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1, partial_rotary_factor=1.0))
