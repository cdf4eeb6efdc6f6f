"""Run metrics and their JSON file."""

import json

import pytest

from moestream.errors import MoestreamError
from moestream.runtime.metrics import GenerationMetrics, StepClock, save_json


def test_clock_splits_first_token_from_later_steps():
    clock = StepClock()
    assert clock.ttft_ms == 0.0 and clock.tpot_ms == 0.0
    clock.marks = [clock.started + 0.5, clock.started + 0.7, clock.started + 1.1]
    assert clock.ttft_ms == pytest.approx(500.0)
    assert clock.tpot_ms == pytest.approx(300.0)


def test_save_json_writes_atomically_into_new_directories(tmp_path):
    metrics = GenerationMetrics(1.0, 2.0, 3, 4, {"disk": 5, "host": 0})
    path = save_json(metrics.to_dict(), tmp_path / "a" / "b.json")
    assert json.loads(path.read_text())["bytes_read"] == {"disk": 5, "host": 0}
    assert [p.name for p in path.parent.iterdir()] == ["b.json"]


def test_save_json_into_a_file_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MoestreamError, match="cannot write"):
        save_json({}, blocker / "out.json")
