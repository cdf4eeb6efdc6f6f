"""What `packed-cpu` computes an expert with, format by format: each format (registered in `PACKED_FORMATS`
under its codec's method) names the linears of a dense weight, each a product from the slot's quantized views
into its columns of the output (loops of packed_cpu.py and packed_rows.py). `PackedExperts` is what the experts
call; beyond `MAX_ROWS` rows (long prefills) it decodes, as a decode's cost does not grow with the rows
(docs/measurements/quant-cpu-kernel.md). Knows codecs' layouts and `ExpertMath`'s stages, not stores,
policies or the runtime."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Mapping

import numpy as np
import torch

from moestream.errors import CheckpointError
from moestream.quant import compressed_tensors, fp8, mxfp4, packed_rows
from moestream.quant.codec import ExpertCodec, Tensors
from moestream.quant.decoder import ExpertDecoder
from moestream.quant.linears import linear_numbers
from moestream.quant.packed_cpu import as_numpy, gptq_product
from moestream.registry import Registry

MAX_ROWS = 64  # rows of one expert computed from its packed bytes; more are decoded (see the docstring)
Layout = Mapping[str, tuple[int, ...]]
Product = Callable[[Tensors, np.ndarray, np.ndarray, int], None]  # (views, x [M, in], out [M, *], first column)


@dataclass(frozen=True)
class Linear:
    """One linear of a dense weight: `product` writes its `outs` columns of the weight's output."""

    product: Product
    outs: int


class PackedFormat:
    """A format `packed-cpu` reads: the codec variants it `covers`, the `linears` of dense weight `param` in order."""

    registry_name: str

    def covers(self, codec: ExpertCodec) -> bool:
        return True

    def linears(self, codec: ExpertCodec, layout: Layout, param: str) -> list[Linear]:
        return [self.linear(codec, layout, f"{param}.{j}") for j in linear_numbers(layout, param)]

    def linear(self, codec: ExpertCodec, layout: Layout, prefix: str) -> Linear:
        raise NotImplementedError


PACKED_FORMATS: Registry[PackedFormat] = Registry("format computed from its packed bytes")


def covers(codec: ExpertCodec | None) -> bool:
    """Whether `packed-cpu` computes this codec's experts."""
    name = getattr(codec, "registry_name", None)
    return name in PACKED_FORMATS and PACKED_FORMATS.create(name).covers(codec)


@PACKED_FORMATS.register("gptq")
class Gptq(PackedFormat):
    """qweight [I / (32 / b), O], scales [g, O], qzeros [g, O / (32 / b)] (stored minus one)."""

    def linear(self, codec, layout, prefix):
        q, scale, zero = (f"{prefix}.{role}" for role in ("q", "scale", "zero"))
        (words, outs), (groups, scaled), zeros = layout[q], layout[scale], layout[zero]
        if scaled != outs or zeros != (groups, -(-outs // (32 // codec.bits))) or words % groups:
            raise CheckpointError(f"gptq: the tensors of expert linear {prefix} do not agree: qweight "
                                  f"{(words, outs)}, scales {(groups, scaled)}, qzeros {zeros}")

        def product(views, x, out, col):
            gptq_product(views[q].numpy(), as_numpy(views[scale]), views[zero].numpy(), codec.bits, x, out, col)
        return Linear(product, outs)


@PACKED_FORMATS.register("compressed-tensors")
class CompressedTensors(PackedFormat):
    """pack-quantized int4/int8 words [O, I / (32 / b)], int-quantized int8 [O, I]; scales [O, I / G], zero points."""

    def covers(self, codec):
        return codec.bits in (4, 8) and (codec.format == compressed_tensors.PACKED or codec.bits == 8)

    def linear(self, codec, layout, prefix):
        packed = codec.format == compressed_tensors.PACKED
        loop = ((packed_rows.int4_words_product if codec.bits == 4 else packed_rows.int8_words_product) if packed
                else packed_rows.int8_rows_product)
        q, scale, zero = (f"{prefix}.{role}" for role in ("q", "scale", "zero"))
        outs, groups = layout[scale]
        if layout[q][0] != outs or (layout[q][1] * (32 // codec.bits if packed else 1)) % groups:
            raise CheckpointError(f"compressed-tensors: the tensors of expert linear {prefix} do not agree: "
                                  f"weight {layout[q]}, scale {layout[scale]}")
        offset = float(1 << (codec.bits - 1)) if packed else 0.0  # what pack-quantized adds to each value
        constant = np.full((outs, groups), offset, np.float32)

        def product(views, x, out, col):
            shifts = constant if zero not in views else constant + codec.zero_points(views[zero], outs).numpy()
            loop(views[q].numpy(), views[scale].float().numpy(), shifts, x, out, col)
        return Linear(product, outs)


@PACKED_FORMATS.register("fp8")
class Fp8Block(PackedFormat):
    """float8_e4m3fn [O, I] and its scales, one per block (or per tensor)."""

    def linear(self, codec, layout, prefix):
        weight, scale = (f"{prefix}.{role}" for role in fp8.ROLES)
        outs, inputs = codec.linear_shape(layout, prefix)  # checks the scales' grid
        rows, cols = codec.block or (outs, inputs)

        def product(views, x, out, col):
            scales = fp8.as_scale(views[scale]).reshape(-(-views[weight].shape[0] // rows), -1).numpy()
            packed_rows.fp8_product(views[weight].view(torch.uint8).numpy(), scales, rows, cols, x, out, col)
        return Linear(product, outs)


@PACKED_FORMATS.register("mxfp4")
class Mxfp4(PackedFormat):
    """GPT-OSS's blocks [R, C / 32, 16] and exponents [R, C / 32]; the weight the model multiplies is [C, R]."""

    def linears(self, codec, layout, param):
        powers = np.append(np.ldexp(np.float32(1), np.arange(255) - mxfp4.BIAS), np.inf).astype(np.float32)  # 2**128
        blocks, exponents = param + mxfp4.BLOCKS, param + mxfp4.SCALES

        def product(views, x, out, col):
            packed_rows.mxfp4_product(views[blocks].numpy(), views[exponents].numpy(), powers, x, out, col)
        return [Linear(product, layout[blocks][0])]


class PackedExperts:
    """A checkpoint's experts for `packed-cpu`: called with slot views it decodes them; `mlp` computes from them."""

    def __init__(self, decoder: ExpertDecoder, codec: ExpertCodec, layout: Layout):
        """layout: the slot's part shapes by name; CheckpointError where a linear's parts disagree (read unchecked)."""
        self.decoder = decoder
        fmt = PACKED_FORMATS.create(codec.registry_name)
        self.linears = {param: fmt.linears(codec, layout, param) for param in decoder.scratch}

    def __call__(self, parts: Tensors) -> Tensors:
        return self.decoder(parts)

    def mlp(self, math, rows: torch.Tensor, parts: Tensors) -> torch.Tensor:
        """One expert's MLP without its post stage (`math`: a FusedExpertMath): rows [n, H] -> [n, H], rows' dtype."""
        if rows.shape[0] > MAX_ROWS:
            weights = self.decoder(parts)
            return math.down(math.act(math.up(rows, weights)), weights)
        up = self.project(rows, parts, math.up_name)  # [n, 2I] or [n, I]
        return self.project(math.act(up), parts, "down_proj")  # [n, H]

    def project(self, x: torch.Tensor, parts: Tensors, param: str) -> torch.Tensor:
        """x [n, in] times the dense weight `param` of an expert's parts (plus its bias) -> [n, out], x's dtype."""
        inputs = np.ascontiguousarray(x.float().numpy())  # [n, in]
        linears = self.linears[param]
        out = np.empty((x.shape[0], sum(linear.outs for linear in linears)), dtype=np.float32)  # [n, out]
        for linear, col in zip(linears, accumulate((linear.outs for linear in linears), initial=0)):
            linear.product(parts, inputs, out, col)
        result, bias = torch.from_numpy(out), parts.get(f"{param}_bias")
        return (result if bias is None else result + bias.float()).to(x.dtype)
