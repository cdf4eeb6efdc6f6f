"""`packed-cpu`'s loop over GPTQ's layout (4 or 8 bits, desc_act false; what `moestream quantize --layout
gptq` writes), and `compile_loop`, how every loop of the kernel is compiled.

GPTQ packs each word along the inputs (qweight [I / (32 / b), O]), so a product x [M, I] -> [M, O] runs with
the outputs in the vector lanes: for each word row w and each of its values j, acc[m, o] += q[(32 / b) w + j,
o] * x[m, (32 / b) w + j] in float32; at each group's end, out[m, o] += scale[g, o] * (acc[m, o] - zero[g, o]
* sum of x[m] over the group). Not bit-identical to the exact path: each weight is (q - zero) * scale
exactly, never rounded to the compute dtype, and the sums run in another order. Knows GPTQ's byte layout
only: no codec object, store, policy or runtime."""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import float32, int32, types
from numba.extending import overload


def compile_loop(function):
    """numba.njit without the GIL (the store's threads run meanwhile), cached on disk where numba can write."""
    options = dict(fastmath=True, boundscheck=False, nogil=True)
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:  # numba's "no locator available": a read-only install without a cache directory
        return numba.njit(**options)(function)


def _group_kernel(bits: int):
    """The compiled loop that sums one group of `bits`-bit GPTQ words: (words [I / (32 / b), O] int32, x [M, I]
    float32, first, last, acc [M, O]) -> acc = x[:, first (32 / b): last (32 / b)] times the values of word
    rows [first, last) (each word's values lowest first). `bits` is a constant of the compiled code, so that
    the shifts are, and the loop over the outputs runs in vector lanes."""
    per_word, mask = 32 // bits, (1 << bits) - 1

    def group(words, x, first, last, acc):
        m = int32(mask)
        acc[:, :] = 0
        for w in range(first, last):
            row = words[w]
            for r in range(x.shape[0]):
                xr, ar, at = x[r], acc[r], per_word * w
                for o in range(row.shape[0]):
                    a = ar[o]
                    for j in range(per_word):
                        a += float32(int32((row[o] >> (bits * j)) & m)) * xr[at + j]
                    ar[o] = a

    return compile_loop(group)


_int4_group, _int8_group = _group_kernel(4), _group_kernel(8)


@compile_loop
def _zeros(packed, bits, out):
    """out [O] = the GPTQ zero points (stored minus one) of one group's packed row [O / (32 / b)], as floats."""
    mask = (1 << bits) - 1
    per_word = 32 // bits
    for k in range(packed.shape[0]):
        word = packed[k]
        for j in range(per_word):
            out[k * per_word + j] = float32(((word >> (bits * j)) + 1) & mask)


@compile_loop
def gptq_product(words, scales, zeros, bits, x, out, col):
    """out[:, col: col + O] = x [M, I] (float32) times GPTQ's weight: words [I / (32 / b), O] int32, scales
    [g, O] (float32, or int16: bf16's bits), zeros [g, O / (32 / b)] int32 (stored minus one), groups of
    I / g inputs in order."""
    groups, outs = scales.shape
    per_group = words.shape[0] // groups
    inputs = per_group * (32 // bits)  # of a group
    acc = np.empty((x.shape[0], outs), np.float32)
    zero, scale = np.empty(zeros.shape[1] * (32 // bits), np.float32), np.empty(outs, np.float32)
    out[:, col: col + outs] = 0
    for g in range(groups):
        if bits == 4:
            _int4_group(words, x, g * per_group, (g + 1) * per_group, acc)
        else:
            _int8_group(words, x, g * per_group, (g + 1) * per_group, acc)
        _zeros(zeros[g], bits, zero)
        widen(scales[g], scale)
        for r in range(x.shape[0]):
            x_sum = x[r, g * inputs: (g + 1) * inputs].sum()
            orow, arow = out[r, col: col + outs], acc[r]
            for o in range(outs):
                orow[o] += scale[o] * (arow[o] - zero[o] * x_sum)


def widen(values: np.ndarray, out: np.ndarray) -> None:
    """out [O] float32 = values [O]: floats, or int16 holding bf16's bits (a float32's high half)."""
    out[:] = (values.astype(np.int32) << 16).view(np.float32) if values.dtype == np.int16 else values


@overload(widen)
def _widen(values, out):
    """widen compiled for the values' type, chosen when gptq_product is compiled."""
    if values.dtype == types.int16:
        def from_bf16(values, out):
            bits = out.view(np.int32)
            for o in range(values.shape[0]):
                bits[o] = int32(values[o]) << 16
        return from_bf16

    def from_float(values, out):
        for o in range(values.shape[0]):
            out[o] = values[o]
    return from_float


def as_numpy(scale: torch.Tensor) -> np.ndarray:
    """Scales as gptq_product reads them: bf16 as its bits (int16, no copy), others as float32."""
    return scale.view(torch.int16).numpy() if scale.dtype == torch.bfloat16 else scale.float().numpy()
