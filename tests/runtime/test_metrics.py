"""Run metrics: time to first token and time per output token."""

import pytest

from moestream.runtime.metrics import StepClock


def test_clock_splits_first_token_from_later_steps():
    clock = StepClock()
    assert clock.ttft_ms == 0.0 and clock.tpot_ms == 0.0
    clock.marks = [clock.started + 0.5, clock.started + 0.7, clock.started + 1.1]
    assert clock.ttft_ms == pytest.approx(500.0)
    assert clock.tpot_ms == pytest.approx(300.0)
