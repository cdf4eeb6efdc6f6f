"""Integer packing shared by the W4A16 layouts: values of `bits` bits packed into int32 words, the
first value in the lowest bits (compressed-tensors' `pack_to_int32`, GPTQ's qweight and qzeros), and
the grouped scale-and-shift that turns integers into weights. Knows no checkpoint, family or runtime.
"""

from __future__ import annotations

import torch

WORD_BITS = 32


def per_word(bits: int) -> int:
    """How many `bits`-bit values one int32 word holds."""
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit values into int32 words")
    return WORD_BITS // bits


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words packed along `dim` -> their unsigned values (int32, in [0, 2**bits)), `dim` widened
    by per_word(bits)."""
    count = per_word(bits)
    shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=packed.device)  # [count]
    moved = packed.movedim(dim, -1)  # [..., n]
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n, count]
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * count).movedim(-1, dim)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 words of 4-bit values packed along the last dim -> int8 [..., 8 n] of those values - 8 (the
    signed values of compressed-tensors' offset encoding). The same as unpack(packed, 4, -1) - 8, in
    three passes over bytes instead of eight over int32 lanes: each byte of a little-endian word holds
    two values, low first, spread into the two bytes of an int16."""
    pairs = packed.view(torch.uint8).to(torch.int16)  # [..., 4 n], one byte each
    low = pairs & 15
    spread = pairs.bitwise_right_shift_(4).bitwise_left_shift_(8).bitwise_or_(low)  # bytes: low, high
    return spread.view(torch.int8).sub_(8)  # [..., 8 n]


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values in [0, 2**bits) -> int32 words packed along `dim` (its size a multiple of
    per_word(bits))."""
    count = per_word(bits)
    moved = values.movedim(dim, -1).to(torch.int64)  # [..., n * count]
    if moved.shape[-1] % count:
        raise ValueError(f"cannot pack {moved.shape[-1]} values {count} to a word")
    grouped = moved.reshape(*moved.shape[:-1], -1, count)  # [..., n, count]
    shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int64, device=values.device)
    words = (grouped << shifts).sum(-1)  # [..., n], in [0, 2**32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement
    return words.to(torch.int32).movedim(-1, dim)


def scaled(ints: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """ints [O, N] (zero points already taken off) times scale [O, N / G] group by group along N -> out
    [O, N], each weight rounded once from its exact product (computed in out's dtype when the scale
    has it, else in float32)."""
    rows, cols = out.shape
    groups = scale.shape[-1]
    if scale.dtype == out.dtype:  # in place: one conversion pass, one multiplication pass
        out.copy_(ints).view(rows, groups, cols // groups).mul_(scale.unsqueeze(-1))
        return out
    values = ints.to(torch.float32).view(rows, groups, cols // groups)  # [O, g, G]
    return out.copy_(values.mul_(scale.float().unsqueeze(-1)).view(rows, cols))
