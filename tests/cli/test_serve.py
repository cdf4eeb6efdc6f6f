"""`moestream serve` refuses bad arguments in one line before loading anything, binds to loopback unless
told, and says at start-up when its routing is replayed."""

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


@pytest.fixture
def served(monkeypatch):
    """Runs `moestream serve` up to the point where it would serve; returns what it would bind."""
    from moestream.serving.server import Server

    bound = []
    monkeypatch.setattr(Server, "run", lambda server: bound.append(server.host))
    return bound


def test_serve_binds_to_loopback_unless_told(tiny_checkpoint, served):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    assert main(["serve", "--model", str(model), "--buffered-io"]) == 0
    assert main(["serve", "--model", str(model), "--buffered-io", "--host", "0.0.0.0"]) == 0
    assert served == ["127.0.0.1", "0.0.0.0"]


def test_serve_says_at_start_up_that_routing_is_replayed(tiny_checkpoint, tmp_path, served, caplog):
    from moestream.checkpoint.index import build_index
    from moestream.trace.format import save_trace
    from tests.synthetic import synthetic_trace

    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    trace = save_trace(synthetic_trace(build_index(model).topology, num_sequences=1, tokens_per_sequence=8),
                       tmp_path / "trace.npz")
    assert main(["serve", "--model", str(model), "--buffered-io"]) == 0
    assert "replayed" not in caplog.text
    assert main(["serve", "--model", str(model), "--buffered-io", "--replay-routing", str(trace)]) == 0
    assert "replayed routing" in caplog.text and str(trace) in caplog.text
