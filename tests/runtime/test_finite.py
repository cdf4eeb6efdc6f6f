"""The non-finite check: finite values pass unchanged, a NaN or an infinity names where it was found."""

import pytest
import torch

from moestream.errors import MoestreamError
from moestream.runtime.finite import NonFiniteError, check_finite


def test_finite_values_pass_unchanged():
    values = torch.randn(3, 8, dtype=torch.bfloat16)
    assert check_finite(values, "here") is values


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_value_is_refused_with_its_place(bad):
    values = torch.zeros(4, 16)
    values[2, 7] = bad
    with pytest.raises(NonFiniteError, match="non-finite values .* in MoE layer 5's output") as error:
        check_finite(values, "MoE layer 5's output")
    assert isinstance(error.value, MoestreamError)
