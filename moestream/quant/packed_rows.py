"""`packed-cpu`'s loops over layouts stored output row by output row, each read where it lies:
- compressed-tensors pack-quantized (`words` int32 [O, I / (32 / b)], each value + 2**(b-1), lowest first)
  and int-quantized (int8 [O, I]), per group of G inputs a scale [O, I / G] and an optional zero point;
- FP8 block (float8_e4m3fn [O, I] read as bytes, one float32 scale per bm x bn block);
- MXFP4 (uint8 blocks [R, C / 32, 16], two e2m1 codes a byte, one e8m0 exponent [R, C / 32] per 32).

Each product turns one output row at a time into float32 weights in a one-row buffer (in L1) by integer
arithmetic in vector lanes, then takes one dot product with each row of x (rearranged once per call where a
row's values interleave). Not bit-identical to decode-then-matmul: weights are never rounded to the compute
dtype and the sums run in another order. Knows byte layouts only: no codec, checkpoint, store or runtime."""

from __future__ import annotations

import numpy as np
from numba import float32, int32

from moestream.quant.packed_cpu import compile_loop

F8_EXPONENT = 120 << 23  # float32's exponent bias (127) minus e4m3's (7), in place
E2M1_EXPONENT = np.int32(126 << 23)  # float32's bias minus e2m1's (1), in place; also 0.5's bits


def _words_kernel(bits: int):
    """The loop over `bits`-bit words packed along each output row; `bits` is a constant of the compiled code."""
    per_word, mask = 32 // bits, (1 << bits) - 1

    def product(words, scales, shifts, x, out, col):
        """words [O, W] int32, scales [O, g] float32, shifts [O, g] float32 (what each value minus: the
        format's offset plus the zero point), x [M, W * per_word] float32 -> out[:, col: col + O]."""
        outs, num_words = words.shape
        rows, size = x.shape[0], per_word * num_words
        lanes = np.empty((rows, size), np.float32)  # x[m, per_word k + j] at [m, j W + k]
        for m in range(rows):
            for k in range(num_words):
                for j in range(per_word):
                    lanes[m, j * num_words + k] = x[m, per_word * k + j]
        weights, low_bits = np.empty(size, np.float32), int32(mask)  # one output row's, in the lanes' order
        word_scales, word_shifts = np.empty(num_words, np.float32), np.empty(num_words, np.float32)
        for o in range(outs):
            row = words[o]
            _spread(scales[o], word_scales)
            _spread(shifts[o], word_shifts)
            for j in range(per_word):
                at, shift = j * num_words, int32(bits * j)
                for k in range(num_words):  # one long loop: short ones cost their set-up each
                    weights[at + k] = (float32((row[k] >> shift) & low_bits) - word_shifts[k]) * word_scales[k]
            for m in range(rows):
                out[m, col + o] = _dot(weights, lanes[m])

    return compile_loop(product)


@compile_loop
def _spread(groups, out):
    """One output row's values per group [g] -> one per word (or value) [W], the groups in order."""
    size = out.shape[0] // groups.shape[0]
    for g in range(groups.shape[0]):
        value = groups[g]
        for k in range(g * size, (g + 1) * size):
            out[k] = value


@compile_loop
def _dot(a, b):
    """sum a * b over two float32 vectors, in float32."""
    total = float32(0)
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total


int4_words_product, int8_words_product = _words_kernel(4), _words_kernel(8)


@compile_loop
def int8_rows_product(values, scales, shifts, x, out, col):
    """values int8 [O, I] (compressed-tensors int-quantized), scales and shifts (zero points) [O, g] float32,
    x [M, I] float32 -> out[:, col: col + O]."""
    outs, inputs = values.shape
    weights = np.empty(inputs, np.float32)
    value_scales, value_shifts = np.empty(inputs, np.float32), np.empty(inputs, np.float32)
    for o in range(outs):
        row = values[o]
        _spread(scales[o], value_scales)
        _spread(shifts[o], value_shifts)
        for i in range(inputs):
            weights[i] = (float32(row[i]) - value_shifts[i]) * value_scales[i]
        for m in range(x.shape[0]):
            out[m, col + o] = _dot(weights, x[m])


@compile_loop
def fp8_product(codes, scales, block_rows, block_cols, x, out, col):
    """codes uint8 [O, I] (float8_e4m3fn's bytes), scales float32 [ceil(O / bm), ceil(I / bn)] (one per block;
    [1, 1] with bm = O, bn = I for one per tensor), x [M, I] float32 -> out[:, col: col + O]."""
    outs, inputs = codes.shape
    scaled = np.empty(x.shape, np.float32)  # x times the block scales of the current block of rows
    bits = np.empty(inputs, np.int32)
    weights = bits.view(np.float32)
    for o in range(outs):
        if o % block_rows == 0:
            for m in range(x.shape[0]):
                for i in range(inputs):
                    scaled[m, i] = x[m, i] * scales[o // block_rows, i // block_cols]
        row = codes[o]
        for i in range(inputs):
            bits[i] = ((int32(row[i]) & 0x7F) << 20) + F8_EXPONENT  # a normal e4m3's value
        for i in range(inputs):
            code = int32(row[i])
            value = float32(code & 7) * float32(2.0 ** -9) if code & 0x78 == 0 else weights[i]  # subnormal
            weights[i] = -value if code & 0x80 else value
        for m in range(x.shape[0]):
            out[m, col + o] = _dot(weights, scaled[m])


@compile_loop
def mxfp4_product(blocks, exponents, powers, x, out, col):
    """blocks uint8 [R, G, 16] (two e2m1 codes a byte, the even column's low), exponents uint8 [R, G], powers
    [256] float32 (2 ** (e - 127)), x [M, 32 G] float32 -> out[:, col: col + R]: out[m, r] = sum over c of
    x[m, c] times W[c, r], the model's weight being the blocks' transpose."""
    outs, groups, half = blocks.shape
    size = groups * half
    even, odd = np.empty((x.shape[0], size), np.float32), np.empty((x.shape[0], size), np.float32)
    for m in range(x.shape[0]):
        for k in range(size):
            even[m, k], odd[m, k] = x[m, 2 * k], x[m, 2 * k + 1]
    low, high = np.empty(size, np.int32), np.empty(size, np.int32)
    low_w, high_w = low.view(np.float32), high.view(np.float32)
    byte_powers = np.empty(size, np.float32)
    group_powers = np.empty(groups, np.float32)
    for r in range(outs):
        codes = blocks[r].reshape(size)
        for g in range(groups):
            group_powers[g] = powers[exponents[r, g]]
        _spread(group_powers, byte_powers)
        for k in range(size):
            code = np.int32(codes[k])
            low[k], high[k] = _e2m1_bits(code & np.int32(15)), _e2m1_bits(np.int32(code >> np.int32(4)))
        for k in range(size):
            low_w[k] *= byte_powers[k]
            high_w[k] *= byte_powers[k]
        for m in range(x.shape[0]):
            out[m, col + r] = _dot(low_w, even[m]) + _dot(high_w, odd[m])


@compile_loop
def _e2m1_bits(code):
    """The float32 bits of an e2m1 code's value (int32 throughout, so that the loop runs 16 codes a vector):
    a normal code's exponent (+ 126) and mantissa placed, a subnormal one's (exponent 0) 0.5 or 0, the sign."""
    i32 = np.int32
    magnitude = i32(code & i32(7))
    normal = i32(-i32(i32(magnitude + i32(6)) >> i32(3)))  # all ones where the exponent is not 0
    placed = i32(i32(magnitude << i32(22)) + E2M1_EXPONENT)
    subnormal = i32(i32(-i32(magnitude & i32(1))) & E2M1_EXPONENT)
    return i32(i32(placed & normal) | i32(subnormal & ~normal) | i32(i32(code & i32(8)) << i32(28)))
