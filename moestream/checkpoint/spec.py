"""What `moestream make-model` writes: a validated ModelSpec, the presets of real models' shapes
(`PRESETS`), a width scale, and the demo checkpoint's settings. Light to import (no torch or
transformers), so the CLI can build its parser quickly."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from moestream.errors import CheckpointError
from moestream.families import FAMILIES, FamilyAdapter, adapter_for

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")  # token ids 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 16  # every byte, the specials, a few merges
DTYPE_NAMES = ("bf16", "fp32")
DEFAULT_TOP_K = 2
# --quant FORMAT: the multiple that hidden and expert widths must be (MXFP4 scales groups of 32 values);
# layouts in checkpoint/quantized.py, the families each is written for in their files (`quant_formats`)
QUANT_WIDTH_MULTIPLE = {"mxfp4": 32, "fp8": 1, "w4a16": 8}


def quant_families() -> dict[str, tuple[str, ...]]:
    """format -> the families whose published checkpoints come in it."""
    return {fmt: tuple(n for n in FAMILIES.names() if fmt in FAMILIES.get(n).quant_formats)
            for fmt in QUANT_WIDTH_MULTIPLE}


@dataclass(frozen=True)
class ModelSpec:
    """What `moestream make-model` writes. `top_k=None` takes the family's (fixed) default."""

    family: str
    num_layers: int = 4
    num_experts: int = 8
    top_k: int | None = None
    hidden_size: int = 64
    intermediate_size: int = 64
    vocab_size: int = 512
    seed: int = 0
    dtype: str = "fp32"
    max_shard_bytes: int | None = None
    config_overrides: dict = field(default_factory=dict)  # extra config fields, applied last
    tokenizer_vocab_size: int | None = None  # a tokenizer smaller than the embedding (None: vocab_size)
    quant: str | None = None  # a QUANT_WIDTH_MULTIPLE format: experts (and what else the format's releases quantize)

    def __post_init__(self):
        adapter = self.adapter()
        fixed = adapter.fixed_top_k
        if self.top_k is not None and fixed is not None and self.top_k != fixed:
            raise CheckpointError(f"family {self.family} routes each token to exactly {fixed} expert(s), "
                                  f"not {self.top_k}")
        if self.num_layers < 1 or self.num_experts < 1 or self.intermediate_size < 1:
            raise CheckpointError("num_layers, num_experts and intermediate_size must be >= 1")
        if not 1 <= self.resolved_top_k <= self.num_experts:
            raise CheckpointError(f"top-k {self.resolved_top_k} must be between 1 and num_experts ({self.num_experts})")
        if self.hidden_size < 16 or self.hidden_size % 16:
            raise CheckpointError(f"hidden size {self.hidden_size} must be a positive multiple of 16")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise CheckpointError(f"vocab size {self.vocab_size} is too small for a byte-level tokenizer "
                                  f"(need >= {MIN_VOCAB_SIZE})")
        if self.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        if self.tokenizer_vocab_size is not None and not MIN_VOCAB_SIZE <= self.tokenizer_vocab_size <= self.vocab_size:
            raise CheckpointError(f"tokenizer vocab size {self.tokenizer_vocab_size} must be between "
                                  f"{MIN_VOCAB_SIZE} and the vocab size ({self.vocab_size})")
        if self.max_shard_bytes is not None and self.max_shard_bytes < 1:
            raise CheckpointError(f"max shard bytes must be >= 1, got {self.max_shard_bytes}")
        if self.quant is not None:
            self._check_quant()

    def _check_quant(self) -> None:
        if self.quant not in QUANT_WIDTH_MULTIPLE:
            raise CheckpointError(f"unknown quantized format {self.quant!r}; formats: {', '.join(QUANT_WIDTH_MULTIPLE)}")
        families = quant_families()[self.quant]
        if self.family not in families:
            raise CheckpointError(f"--quant {self.quant} is written for {', '.join(families)}, not {self.family}")
        multiple = QUANT_WIDTH_MULTIPLE[self.quant]
        if self.hidden_size % multiple or self.intermediate_size % multiple:
            raise CheckpointError(f"--quant {self.quant} needs hidden and intermediate sizes that are multiples "
                                  f"of {multiple}, got {self.hidden_size} and {self.intermediate_size}")

    def adapter(self) -> FamilyAdapter:
        return adapter_for(SimpleNamespace(model_type=self.family))

    @property
    def resolved_top_k(self) -> int:
        fixed = self.adapter().fixed_top_k
        return self.top_k if self.top_k is not None else (fixed if fixed is not None else DEFAULT_TOP_K)


def demo_spec() -> ModelSpec:
    """DeepSeek-V2-Lite's topology (27 layers, layer 0 dense; 26 MoE layers of 64 routed experts, top-6,
    2 shared experts, greedy softmax routing) at reduced width: about 1.07 GiB of bf16 routed experts."""
    return ModelSpec(family="deepseek_v2", num_layers=27, num_experts=64, top_k=6, hidden_size=256,
                     intermediate_size=448, vocab_size=1024, dtype="bf16", max_shard_bytes=256 * 2**20,
                     config_overrides=dict(n_shared_experts=2, topk_method="greedy", n_group=1, topk_group=1))


# DeepSeek-V2-Lite's config.json fields that shape the model (beyond ModelSpec's own): 27 layers, layer 0
# dense (width 10944), 64 routed experts of width 1408 (top-6, greedy softmax routing) and 2 shared,
# multi-head latent attention with 16 heads, kv_lora_rank 512, no q LoRA, YaRN rope.
DEEPSEEK_V2_LITE_FIELDS = dict(
    n_shared_experts=2, first_k_dense_replace=1, intermediate_size=10944, topk_method="greedy", n_group=1,
    topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, num_attention_heads=16, num_key_value_heads=16,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=163840, rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
)
WIDTH_FIELDS = ("num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank")  # scale with hidden


def deepseek_v2_lite_spec() -> ModelSpec:
    """DeepSeek-V2-Lite's full shape (bf16): 17.3 MB per routed expert, 28.8 GB of routed experts, about
    31.4 GB in all. The tokenizer is the packaged one (1024 tokens) under the real 102400-row embedding."""
    return ModelSpec(family="deepseek_v2", num_layers=27, num_experts=64, top_k=6, hidden_size=2048,
                     intermediate_size=1408, vocab_size=102400, tokenizer_vocab_size=1024, dtype="bf16",
                     max_shard_bytes=4 * 2**30, config_overrides=dict(DEEPSEEK_V2_LITE_FIELDS))


PRESETS = {"deepseek-v2-lite": deepseek_v2_lite_spec}


def preset_spec(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise CheckpointError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


def width_scaled(spec: ModelSpec, factor: float) -> ModelSpec:
    """The spec with its hidden width (and the attention widths following it) scaled by `factor`; experts keep it."""
    if not 0.0 < factor <= 64.0:
        raise CheckpointError(f"width scale must be in (0, 64], got {factor}")
    hidden = max(16, int(round(spec.hidden_size * factor / 16)) * 16)
    overrides = {name: max(1, int(round(value * factor))) if name in WIDTH_FIELDS and value else value
                 for name, value in spec.config_overrides.items()}
    return replace(spec, hidden_size=hidden, config_overrides=overrides)
