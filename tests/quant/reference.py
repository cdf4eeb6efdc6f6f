"""Reference dequantizations written from each format's documentation, independently of moestream.quant
(numpy, element arithmetic in float64, one rounding to the target dtype)."""

from __future__ import annotations

import numpy as np
import torch


def nibbles(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint32 words -> their `bits`-bit fields, lowest first, spread along `axis`."""
    words = words.astype(np.uint32)
    fields = [(words >> np.uint32(bits * i)) & np.uint32(2**bits - 1) for i in range(32 // bits)]
    stacked = np.stack(fields, axis=axis + 1).astype(np.int64)  # [..., n, count, ...]
    shape = list(words.shape)
    shape[axis] *= 32 // bits
    return stacked.reshape(shape)


def _as(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float32)).to(dtype)  # exact products: one rounding


def _groups(scale: torch.Tensor, cols: int) -> np.ndarray:
    s = scale.float().numpy().astype(np.float64)
    return np.repeat(s, cols // s.shape[1], axis=1)


def compressed_tensors(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, packed: bool,
                       dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors: pack_to_int32 stores value + 2**(b-1) along rows (zero points along dim 0);
    weight = (q - zero_point) * scale per group of columns."""
    offset = 2 ** (bits - 1)
    ints = nibbles(q.numpy().view(np.uint32), bits, 1) - offset if packed else q.numpy().astype(np.int64)
    rows, cols = ints.shape
    if zero is None:
        z = np.zeros((rows, scale.shape[1]), dtype=np.int64)
    elif packed:
        z = (nibbles(zero.numpy().view(np.uint32), bits, 0) - offset)[:rows]
    else:
        z = zero.numpy().astype(np.int64)
    z = np.repeat(z, cols // z.shape[1], axis=1)
    return _as((ints - z) * _groups(scale, cols), dtype)


def gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
         dtype: torch.dtype) -> torch.Tensor:
    """AutoGPTQ's dequantize_weight: w[i, o] = scales[g_idx[i], o] * (q[i, o] - ((qzeros[g, o] + 1) & mask));
    returned as the [O, I] weight of F.linear."""
    q = nibbles(qweight.numpy().view(np.uint32), bits, 0)  # [I, O]
    z = (nibbles(qzeros.numpy().view(np.uint32), bits, 1) + 1) & (2**bits - 1)  # [G, O]
    g = g_idx.numpy().astype(np.int64)
    s = scales.float().numpy().astype(np.float64)
    return _as(((q - z[g]) * s[g]).T, dtype)
