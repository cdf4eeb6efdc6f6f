"""The int4 table-lookup decode (`packing.scaled_nibbles`) is bit for bit the decode it replaced
(unpack, take the offset and zero points off as integers, `packing.scaled`) and the independent
numpy reference, for every 16-bit key, symmetric or not, in each compute dtype and scale dtype."""

import pytest
import torch

from moestream.quant import packing
from tests.quant import reference


def every_key_words(rows: int) -> torch.Tensor:
    """int32 words [rows, 32768 / rows] whose 16-bit halves are the keys 0..65535, each once."""
    keys = torch.arange(1 << 16, dtype=torch.int64).view(-1, 2)  # [32768, 2]: low half, high half
    words = keys[:, 0] | (keys[:, 1] << 16)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(rows, -1)


def integer_decode(q, scale, zero, out):
    """The decode before the lookup table: integers, then scaled()."""
    ints = packing.unpack(q, 4, dim=1) - 8  # [O, I]
    if zero is not None:
        zeros = packing.unpack(zero, 4, dim=0)[: q.shape[0]] - 8  # [O, I/G]
        ints = ints - zeros.repeat_interleave(ints.shape[1] // zeros.shape[1], dim=1)
    return packing.scaled(ints, scale, out)


def table_of(dtype, device):
    return packing.nibble_table(dtype, device)


@pytest.mark.parametrize("out_dtype,scale_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                   (torch.float32, torch.float32), (torch.float64, torch.float64),
                                                   (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_lookup_decode_is_bitwise_the_integer_decode_and_the_reference(out_dtype, scale_dtype, symmetric):
    g = torch.Generator().manual_seed(0)
    q = every_key_words(256)  # [256, 128]: I = 1024
    groups = 1024 // 32
    scale = (torch.rand(256, groups, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    zero = None
    if not symmetric:
        zints = torch.randint(0, 16, (256, groups), generator=g, dtype=torch.int32)
        zero = packing.pack(zints, 4, dim=0)  # [256 / 8, g], packed along O
    zeros = None if zero is None else packing.unpack(zero, 4, dim=0) - 8
    got = packing.scaled_nibbles(q, scale, zeros, torch.full((256, 1024), float("nan"), dtype=out_dtype), table_of)
    assert torch.equal(got, integer_decode(q, scale, zero, torch.empty(256, 1024, dtype=out_dtype)))
    if out_dtype != torch.float64:  # the reference rounds its float64 products through float32
        assert torch.equal(got, reference.compressed_tensors(q, scale, zero, 4, True, out_dtype))


def test_lookup_decode_of_an_expert_matrix_group_128():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-2**31, 2**31 - 1, (2816, 128), generator=g, dtype=torch.int32)  # [2816, 1024] int4
    scale = (torch.rand(2816, 8, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    got = packing.scaled_nibbles(q, scale, None, torch.empty(2816, 1024, dtype=torch.bfloat16), table_of)
    assert torch.equal(got, integer_decode(q, scale, None, torch.empty(2816, 1024, dtype=torch.bfloat16)))
    assert torch.equal(got, reference.compressed_tensors(q, scale, None, 4, True, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_table_entries_are_four_or_two_values_minus_eight(dtype):
    table = packing.nibble_table(dtype)
    values = table.view(dtype).view(table.numel(), -1)  # [2**K, K / 4]
    key = 0x3F if dtype == torch.float32 else 0xA53F
    expected = [15 - 8, 3 - 8] if dtype == torch.float32 else [15 - 8, 3 - 8, 5 - 8, 10 - 8]
    assert values[key].tolist() == expected
