"""Integer packing shared by the W4A16 layouts: values of `bits` bits packed into int32 words, the
first value in the lowest bits (compressed-tensors' `pack_to_int32`, GPTQ's qweight and qzeros), the
grouped scale-and-shift that turns integers into weights, and its 4-bit shortcut: a table lookup from
the packed words straight into the compute dtype. Knows no checkpoint, family or runtime."""

from __future__ import annotations

import functools
from typing import Callable

import torch

WORD_BITS = 32


def per_word(bits: int) -> int:
    """How many `bits`-bit values one int32 word holds."""
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit values into int32 words")
    return WORD_BITS // bits


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words packed along `dim` -> their unsigned values (int32), `dim` widened by per_word(bits)."""
    count = per_word(bits)
    shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=packed.device)  # [count]
    moved = packed.movedim(dim, -1)  # [..., n]
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n, count]
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * count).movedim(-1, dim)


@functools.cache  # built once per (dtype, device); read-only
def nibble_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """decode_nibbles' lookup table for a 2- or 4-byte float dtype: [2**K] int64, K = 32 / its bytes (16 for
    bf16 and fp16, 8 for fp32). Entry k holds the K / 4 4-bit values of key k, lowest first, each minus 8
    (compressed-tensors' offset) in `dtype`: their bit patterns side by side, 8 bytes in all."""
    per_entry = 8 // dtype.itemsize
    keys = torch.arange(1 << (4 * per_entry), device=device)  # [2**K]
    shifts = torch.arange(0, 4 * per_entry, 4, device=device)  # [K / 4]
    values = ((keys.unsqueeze(-1) >> shifts) & 15) - 8  # [2**K, K / 4], exact in any float dtype
    return values.to(dtype).contiguous().view(torch.int64).view(-1)


def decode_nibbles(packed: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """int32 words of 4-bit values packed along the last dim [O, n] -> out [O, 8 n] (contiguous, 2- or 4-byte
    dtype, `table` = nibble_table(out.dtype)): each value - 8, as unpack(packed, 4, -1) - 8. One lookup per
    K bits of a little-endian word (its lowest value first) writes K / 4 values at once."""
    key_bits = 32 // out.element_size()  # K
    keys = packed.reshape(-1).view(torch.int16 if key_bits == 16 else torch.uint8).int()  # [O n 32 / K]
    if key_bits == 16:
        keys.bitwise_and_(0xFFFF)  # int16 read as unsigned
    torch.index_select(table, 0, keys, out=out.view(-1).view(torch.int64))
    return out


def scaled_nibbles(packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, out: torch.Tensor,
                   table_of: Callable[[torch.dtype, torch.device], torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' int4 words [O, I / 8] -> out [O, I] = (q - 8 - zeros) * scale group by group along
    I (zeros, scale: [O, I / G]), bit for bit what scaled() gives for those integers: they land in the work
    dtype (scaled()'s) by table lookup (table_of(dtype, device) -> nibble_table(dtype, device)), exact small
    integers; the zero points come off exactly there (|q - 8 - zero| <= 15); then one rounded product."""
    rows, cols = out.shape
    groups = scale.shape[-1]
    work = out if scale.dtype == out.dtype else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    looked = work if work.element_size() in (2, 4) else torch.empty_like(work, dtype=torch.float32)
    decode_nibbles(packed, table_of(looked.dtype, looked.device), looked)
    grouped = (work if looked is work else work.copy_(looked)).view(rows, groups, cols // groups)  # [O, g, G]
    if zeros is not None:
        grouped.sub_(zeros.to(work.dtype).unsqueeze(-1))
    grouped.mul_(scale.to(work.dtype).unsqueeze(-1))
    return out if work is out else out.copy_(work)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values in [0, 2**bits) -> int32 words packed along `dim` (its size a multiple of per_word(bits))."""
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
    """ints [O, N] (zero points already taken off) times scale [O, N / G] group by group along N -> out [O, N], each
    weight rounded once from its exact product (computed in out's dtype when the scale has it, else in float32)."""
    rows, cols = out.shape
    groups = scale.shape[-1]
    if scale.dtype == out.dtype:  # in place: one conversion pass, one multiplication pass
        out.copy_(ints).view(rows, groups, cols // groups).mul_(scale.unsqueeze(-1))
        return out
    values = ints.to(torch.float32).view(rows, groups, cols // groups)  # [O, g, G]
    return out.copy_(values.mul_(scale.float().unsqueeze(-1)).view(rows, cols))
