"""A small test model's config for any family: the config class defaults with their size fields (widths, head,
expert and layer counts, per-layer lists) shrunk by name, so `moestream make-model` writes a checkpoint of seconds
for any model type; what a config validates beyond them goes in the family's `tiny_fields`. Knows no family."""

from __future__ import annotations

import math
from dataclasses import dataclass

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")
EXPERT_WIDTH_FIELDS = ("moe_intermediate_size",)  # the routed experts' width where the config has it
SHARED_WIDTH_FIELDS = ("shared_expert_intermediate_size", "shared_intermediate_size",
                       "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size")
TEXT_KEYS = ("text", "thinker")  # sub-configs that hold (or lead to) the text model's config
LAYER_LIST_FIELDS = ("layer_types", "mlp_layer_types", "kv_source_layers", "moe_layer_types")


@dataclass(frozen=True)
class Sizes:
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # the routed experts' width
    vocab_size: int


def expert_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) making group-limited routing bite: groups of >= max(2, top_k); (1, 1) if none fit."""
    least = max(2, top_k)
    for n_group in (4, 2):
        size = num_experts // n_group
        if num_experts % n_group == 0 and size >= least:
            return n_group, min(n_group, max(math.ceil(top_k / size), n_group // 2))
    return 1, 1


def _widths(present: dict, sizes: Sizes) -> dict:
    """Small values of the size fields, by name (the caller keeps those the config has)."""
    heads = max(1, sizes.hidden_size // 16)
    default_heads, default_kv = present.get("num_attention_heads"), present.get("num_key_value_heads")
    grouped = isinstance(default_heads, int) and isinstance(default_kv, int) and default_kv < default_heads
    expert_width = sizes.intermediate_size
    fields = dict(hidden_size=sizes.hidden_size, num_hidden_layers=sizes.num_layers, vocab_size=sizes.vocab_size,
        num_attention_heads=heads, num_key_value_heads=heads // 2 if grouped and heads % 2 == 0 else heads,
        head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
        kv_lora_rank=max(16, sizes.hidden_size // 4), qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        qk_head_dim=24, index_topk=16, index_head_dim=16, index_n_heads=2,
        linear_head_dim=16, linear_num_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, first_k_dense_replace=1, num_dense_layers=1,
        mamba_d_state=16, ssm_state_size=16, mamba_d_head=16, mamba_head_dim=16, n_groups=1,
        mamba_n_heads=2 * sizes.hidden_size // 16, mamba_num_heads=2 * sizes.hidden_size // 16, mamba_expand=2,
        expand=2, mamba_chunk_size=16, chunk_size=16, mamba_dt_rank=max(1, sizes.hidden_size // 16),
        dense_intermediate_size=2 * expert_width, o_lora_rank=16, o_groups=2)
    if present.get("q_lora_rank"):
        fields["q_lora_rank"] = max(16, sizes.hidden_size // 2)
    has_expert_width = any(present.get(f) is not None for f in EXPERT_WIDTH_FIELDS)
    fields["intermediate_size"] = 2 * expert_width if has_expert_width else expert_width
    fields |= {f: expert_width for f in EXPERT_WIDTH_FIELDS + SHARED_WIDTH_FIELDS}
    fields |= {f: sizes.num_experts for f in EXPERT_COUNT_FIELDS}
    fields |= {f: sizes.top_k for f in TOP_K_FIELDS}
    fields["n_group"], fields["topk_group"] = expert_groups(sizes.num_experts, sizes.top_k)
    fields["num_expert_group"] = fields["n_group"]  # n_group's name in some configs
    return fields


def layer_list(values: list, num_layers: int) -> list:
    """The first num_layers entries of a per-layer list, the last giving way to kinds the first ones miss."""
    kept = list(values[:num_layers])
    missing = [kind for kind in dict.fromkeys(values) if kind not in kept]
    if missing and len(missing) < num_layers:
        kept[num_layers - len(missing):] = missing
    return kept


def _mrope(rope, head_dim: int):
    """A multimodal rope's sections rescaled to sum to head_dim // 2."""
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return rope
    sections = rope["mrope_section"]
    half, parts = head_dim // 2, len(sections)
    scaled = [half // parts] * parts
    scaled[0] += half - sum(scaled)
    return rope | {"mrope_section": scaled}


# fields a config may leave None to mean "derived" or "by default": set wherever the config has them
ALWAYS_SET = EXPERT_COUNT_FIELDS + TOP_K_FIELDS + EXPERT_WIDTH_FIELDS + ("head_dim", "num_key_value_heads", "n_group",
                                                                        "topk_group")


def _kept(present: dict, name: str, value):
    """A small value in the shape of the config's own: a list stays a list of its length."""
    default = present.get(name)
    return [value] * len(default) if isinstance(default, list) and not isinstance(value, list) else value


def shrink_fields(present: dict, sizes: Sizes) -> dict:
    """The size fields of a config (as a dict) at their small values."""
    fields = {k: _kept(present, k, v) for k, v in _widths(present, sizes).items()
              if present.get(k) is not None or (k in ALWAYS_SET and k in present)}
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # multi-head latent attention: rope's width
        fields["head_dim"] = fields["qk_rope_head_dim"]
    for name in LAYER_LIST_FIELDS:
        if isinstance(present.get(name), list) and len(present[name]) >= sizes.num_layers:
            fields[name] = layer_list(present[name], sizes.num_layers)
    if isinstance(present.get("per_layer_config"), dict):  # per-layer overrides of layers that remain
        fields["per_layer_config"] = {k: v for k, v in present["per_layer_config"].items() if int(k) < sizes.num_layers}
    for name in ("rope_parameters", "rope_scaling"):
        if present.get(name) is not None:
            rope_dim = fields.get("qk_rope_head_dim", fields.get("head_dim", 16))
            fields[name] = _mrope(present[name], rope_dim)
    return fields


def shrink(model_type: str, sizes: Sizes, text_fields: dict | None = None) -> dict:
    """Config kwargs of a small `model_type`: the text model's size fields and `text_fields` (nested if multimodal)."""
    from transformers import AutoConfig

    return _nested(AutoConfig.for_model(model_type).to_dict(), sizes, text_fields or {})


def text_kwargs(present: dict, fields: dict) -> dict:
    """Config kwargs that set `fields` in the text config of a config dict (itself, or nested)."""
    subs = [k for k, v in present.items() if isinstance(v, dict) and "model_type" in v and k.startswith(TEXT_KEYS)]
    return {k: present[k] | text_kwargs(present[k], fields) for k in subs} if subs else dict(fields)


def _nested(present: dict, sizes: Sizes, text_fields: dict) -> dict:
    """A config dict shrunk: the text model's fields, every sub-config (tower, text config), the joins at text width."""
    subs = {k: v for k, v in present.items() if isinstance(v, dict) and "model_type" in v}
    if not subs:
        return shrink_fields(present, sizes) | text_fields
    out = {k: present[k] | _nested(present[k], sizes, text_fields) if k.startswith(TEXT_KEYS) else
           present[k] | _tower(present[k], sizes) for k in subs}
    return out | {"tie_word_embeddings": False} | {k: sizes.hidden_size for k in JOINS if k in present}


TOWER_FIELDS = dict(depth=1, num_hidden_layers=1, num_layers=1, num_heads=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, hidden_size=32, intermediate_size=64, embed_dim=32)
JOINS = ("text_hidden_size", "out_hidden_size", "projector_hidden_size", "text_config_hidden_size")


def _tower(present: dict, sizes: Sizes) -> dict:
    """A vision or audio tower at one small layer, its output at the text's width."""
    small = {k: _kept(present, k, v) for k, v in TOWER_FIELDS.items() if present.get(k) is not None}
    return small | {k: sizes.hidden_size for k in JOINS if k in present}
