"""GLM-4.5V / 4.6V: its text model's multimodal rope splits the rotated half of each head in three
sections (`mrope_section`, which the config leaves unset and the model defaults to a full-size [8, 12, 12]);
a small test model's sections fit its rotated width (head 16, half rotated: 4 frequencies)."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("glm4v_moe")
class Glm4vMoeAdapter(FamilyAdapter):
    tiny_fields = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                            mrope_section=[2, 1, 1]))
