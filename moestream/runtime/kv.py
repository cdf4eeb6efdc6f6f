"""Per-sequence KV caches for batches whose membership changes between steps.

A `SeqCache` holds one sequence's keys and values at every attention layer, without padding; `merge`
left-pads them to the longest and concatenates along the batch, `split` cuts each row's tokens back out.
Left padding keeps each row's tokens contiguous and right-aligned, so masks, position ids and sliding
windows see exactly what a sequence run alone sees. Knows no model, policy or server.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.cache_utils import DynamicLayer


@dataclass
class SeqCache:
    """One sequence's past: keys and values [1, H, L, D] per attention layer."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[-2]) if self.layers else 0

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def num_bytes(cache) -> int:
    """The bytes of a transformers cache's keys and values (an encoder-decoder's: both of its caches)."""
    parts = [cache.self_attention_cache, cache.cross_attention_cache] if isinstance(cache, EncoderDecoderCache) else [cache]
    tensors = [t for part in parts for layer in part.layers for t in (layer.keys, layer.values)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def mergeable(model) -> bool:
    """Whether the model's past is keys and values at every layer (no recurrent state, no cache class of
    its own), which `merge` and `split` can cut per sequence."""
    if not model._supports_default_dynamic_cache():
        return False
    layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    return all(isinstance(layer, DynamicLayer) for layer in layers)


def empty_cache() -> DynamicCache:
    return DynamicCache()  # full layers, no sliding-window trimming: `split` can cut its result


def merge(caches: list[SeqCache]) -> tuple[DynamicCache, torch.Tensor]:
    """The batch cache of the sequences, left padded to the longest, and its attention mask [B, W]."""
    width = max(c.length for c in caches)
    layers = []
    for layer in range(len(caches[0].layers)):
        keys = torch.cat([_left_pad(c.layers[layer][0], width) for c in caches])  # [B, H, W, D]
        values = torch.cat([_left_pad(c.layers[layer][1], width) for c in caches])  # [B, H, W, D]
        layers.append((keys, values))
    mask = torch.zeros((len(caches), width), dtype=torch.long)  # [B, W]
    for row, cache in enumerate(caches):
        mask[row, width - cache.length:] = 1
    return DynamicCache(ddp_cache_data=layers), mask


def split(cache: DynamicCache, lengths: list[int]) -> list[SeqCache]:
    """Each row's last lengths[row] positions, copied so the batch can be freed."""
    out = []
    for row, length in enumerate(lengths):
        layers = [(layer.keys[row: row + 1, :, -length:].clone(), layer.values[row: row + 1, :, -length:].clone())
                  for layer in cache.layers]  # each [1, H, length, D]
        out.append(SeqCache(layers))
    return out


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[-2]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros(tensor.shape[:-2] + (missing, tensor.shape[-1]))
    return torch.cat([pad, tensor], dim=-2)
