"""Muse Spark: its experts run at a pooled width (`moe_hidden_size`), its text layers list a rope base each
(`layer_rope_theta`, 0: no rope), and its towers keep per-layer lists (the vision tower's attention kinds,
the audio pyramid's stages); a small test model shrinks all of them with its layers."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("muse_spark")
class MuseSparkAdapter(FamilyAdapter):
    tiny_fields = dict(sliding_window=16)

    def tiny_config_kwargs(self, sizes):
        kwargs = super().tiny_config_kwargs(sizes)
        text = kwargs["text_config"]
        text |= dict(moe_hidden_size=sizes.hidden_size // 2, layer_rope_theta=[
            0 if kind == "full_attention" else text["rope_parameters"]["rope_theta"] for kind in text["layer_types"]])
        kwargs["vision_config"] |= dict(layer_types=["full_attention"])
        kwargs["audio_config"] |= dict(patch_sizes=[16], hidden_sizes=[32], depths=[1])
        return kwargs
