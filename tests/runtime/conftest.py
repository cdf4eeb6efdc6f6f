"""Shared helpers of the runtime tests: small checkpoints of every family and the reference run."""

from pathlib import Path

import pytest
import torch
import transformers

from moestream.families import FAMILIES
from moestream.families.derive import text_part

PROMPTS = ("The cat sat on", "def add(a, b):\n    return", "Experts")


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint):
    """checkpoint(family, **spec) -> a small random checkpoint of 3 layers (2 MoE layers for DeepSeek)."""

    def make(family: str, **spec) -> Path:
        return tiny_checkpoint(family, **({"num_layers": 3} | spec))

    return make


def auto_class(family: str):
    return getattr(transformers, FAMILIES.get(family).auto_class)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, S] of prompts padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def reference_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """Greedy tokens of the unmodified transformers model (an omni wrapper's thinker), cut after the first EOS."""
    model = text_part(model)
    ids, mask = left_pad(prompts, pad_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    generated = out[:, 1:] if model.config.is_encoder_decoder else out[:, ids.shape[1]:]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [_cut(row, eos) for row in generated.tolist()]


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
