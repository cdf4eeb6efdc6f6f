"""The read-batch line: least squares from running sums, over any span of a run."""

import pytest

from moestream.read_fit import ReadBatchFit


def test_the_line_of_exact_batches_is_their_fixed_part_and_per_expert_time():
    fit = ReadBatchFit()
    for experts in (1, 2, 3, 6, 6, 2):
        fit.add(experts, 0.0004 + 0.0007 * experts)
    fixed, per_expert = fit.line()
    assert fixed == pytest.approx(0.0004) and per_expert == pytest.approx(0.0007)


def test_noisy_batches_give_the_least_squares_line():
    import numpy as np

    rng = np.random.default_rng(0)
    experts = rng.integers(1, 8, size=200)
    seconds = 0.001 + 0.0005 * experts + rng.normal(0, 1e-4, size=200)
    fit = ReadBatchFit()
    for n, t in zip(experts.tolist(), seconds.tolist()):
        fit.add(n, t)
    slope, intercept = np.polyfit(experts, seconds, 1)
    assert fit.line() == pytest.approx((intercept, slope))


def test_a_span_is_the_sums_at_its_end_less_those_at_its_start():
    fit = ReadBatchFit()
    fit.add(5, 1.0)  # before the span: far off the span's line
    start = ReadBatchFit(**vars(fit))
    for experts in (1, 3):
        fit.add(experts, 0.5 + 0.25 * experts)
    span = fit.since(start)
    assert span.batches == 2 and span.line() == pytest.approx((0.5, 0.25))
    assert span.plus(start) == fit


def test_no_line_without_two_batch_sizes_or_a_rising_one_and_none_below_the_origin():
    one_size = ReadBatchFit()
    for _ in range(3):
        one_size.add(4, 0.002)
    assert one_size.line() is None and ReadBatchFit().line() is None
    below_origin = ReadBatchFit()
    below_origin.add(1, 0.001)
    below_origin.add(2, 0.0025)  # the least-squares line crosses x = 0 at -0.5 ms: the mean per expert instead
    assert below_origin.line() == pytest.approx((0.0, 0.0035 / 3))
    falling = ReadBatchFit()
    falling.add(1, 0.003)
    falling.add(4, 0.001)  # more experts, less time: no cost line
    assert falling.line() is None
