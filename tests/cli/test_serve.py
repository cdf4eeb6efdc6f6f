"""`moestream serve` refuses bad arguments in one line before loading anything."""

import pytest

from moestream.cli import main


@pytest.mark.parametrize("extra, message", [
    (["--port", "70000"], "--port"),
    (["--expert-budget", "lots"], "budget"),
    (["--max-batch-size", "0"], "max_batch_size"),
])
def test_bad_arguments_exit_2(tiny_checkpoint, capsys, extra, message):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    assert main(["serve", "--model", str(model), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_checkpoint_exits_2(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
