"""Gemma 4: the MoE releases (26B-A4B) enable a routed block beside the dense MLP (`enable_moe_block`). A
small test model is shaped like that release: no per-layer input embeddings, full-attention layers with
wider heads and fewer key-value heads whose keys are the values (`attention_k_eq_v`), final logit
soft-capping, and a short sliding window."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("gemma4")
class Gemma4Adapter(FamilyAdapter):
    tiny_fields = dict(enable_moe_block=True, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                       final_logit_softcapping=30.0, sliding_window=16)

    def tiny_config_kwargs(self, sizes):
        kwargs = super().tiny_config_kwargs(sizes)
        text = kwargs["text_config"]
        text["per_layer_config"] = {i: dict(head_dim=32, num_key_value_heads=1)
                                    for i, kind in enumerate(text["layer_types"]) if kind == "full_attention"}
        return kwargs
