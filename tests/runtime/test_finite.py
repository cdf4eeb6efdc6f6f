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


def test_a_step_s_flags_start_true_and_a_bad_mark_is_not_undone_by_a_good_one():
    from moestream.runtime.finite import FiniteFlags
    from moestream.runtime.host_reads import HostReads

    flags = FiniteFlags(["layer 0", "layer 1"], "cpu", HostReads())
    flags.begin()
    flags.mark(1, torch.tensor([float("nan")]))  # the step then raised before its logits were read
    flags.begin()  # the next step
    flags.mark(0, torch.ones(2))
    flags.mark(1, torch.ones(2))
    assert flags.read(torch.zeros(1, 4))[0].shape == (1, 4)
    flags.begin()
    flags.mark(0, torch.tensor([float("inf")]))
    flags.mark(0, torch.ones(2))  # a later finite value at the same place hides nothing
    with pytest.raises(NonFiniteError, match="in layer 0"):
        flags.read(torch.zeros(1, 4))
