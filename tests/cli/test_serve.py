"""`moestream serve` refuses bad arguments in one line before loading anything, binds to loopback unless
told, and says at start-up when its routing is replayed."""

import pytest

from moestream.cli import main


@pytest.mark.parametrize("extra, message", [
    (["--port", "70000"], "--port"),
    (["--expert-budget", "lots"], "budget"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    (["--max-num-seqs", "-1"], "--max-num-seqs must be >= 0, got -1"),
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
    monkeypatch.setattr(Server, "run", lambda server, sock=None: bound.append(sock.getsockname()[0]))
    return bound


def test_serve_binds_to_loopback_unless_told(tiny_checkpoint, served):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    assert main(["serve", "--model", str(model), "--buffered-io", "--port", "0"]) == 0
    assert main(["serve", "--model", str(model), "--buffered-io", "--host", "0.0.0.0", "--port", "0",
                 "--api-key", "k"]) == 0
    assert served == ["127.0.0.1", "0.0.0.0"]


def test_an_empty_api_key_is_refused_in_one_line_before_anything_loads(tiny_checkpoint, served, capsys):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    for key in ("", "  "):
        assert main(["serve", "--model", str(model), "--port", "0", "--api-key", key]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moestream: error: --api-key is empty") and len(err.splitlines()) == 1
    assert served == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_no_key_off_loopback_needs_allow_unauthenticated(tiny_checkpoint, served, capsys, host):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    assert main(["serve", "--model", str(model), "--buffered-io", "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--host {host} without --api-key" in err and "--allow-unauthenticated" in err
    assert len(err.splitlines()) == 1 and served == []
    if host == "0.0.0.0":  # IPv6 may be off in a container
        assert main(["serve", "--model", str(model), "--buffered-io", "--host", host, "--port", "0",
                     "--allow-unauthenticated"]) == 0
        assert served == [host]


def test_the_start_up_says_whether_the_server_is_unauthenticated(tiny_checkpoint, served, caplog):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    assert main(["serve", "--model", str(model), "--buffered-io", "--port", "0"]) == 0
    assert "the server is unauthenticated" in caplog.text
    caplog.clear()
    assert main(["serve", "--model", str(model), "--buffered-io", "--port", "0", "--api-key", "k"]) == 0
    assert "unauthenticated" not in caplog.text and "compute uses" in caplog.text


def test_serve_says_at_start_up_that_routing_is_replayed(tiny_checkpoint, tmp_path, served, caplog):
    from moestream.checkpoint.index import build_index
    from moestream.trace.format import save_trace
    from tests.synthetic import synthetic_trace

    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    trace = save_trace(synthetic_trace(build_index(model).topology, num_sequences=1, tokens_per_sequence=8),
                       tmp_path / "trace.npz")
    assert main(["serve", "--model", str(model), "--buffered-io", "--port", "0"]) == 0
    assert "replayed" not in caplog.text
    assert main(["serve", "--model", str(model), "--buffered-io", "--port", "0", "--replay-routing", str(trace)]) == 0
    assert "replayed routing" in caplog.text and str(trace) in caplog.text


def test_a_port_in_use_or_an_unknown_host_is_one_line_before_the_model_loads(tiny_checkpoint, capsys):
    import socket

    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(model), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err and "serving" not in err
    assert main(["serve", "--model", str(model), "--host", "no-such-host.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host no-such-host.invalid: cannot resolve it" in err and len(err.strip().splitlines()) == 1


def test_ctrl_c_drains_a_stream_in_flight_and_exits_0_in_one_line(tiny_checkpoint):
    import json
    import signal
    import subprocess
    import sys
    import threading
    import time

    import httpx

    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    server = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "--model", str(model), "--port", "0",
                               "--buffered-io"], stderr=subprocess.PIPE, text=True)
    try:
        url, started = _announced_url(server)
        chunks, first = [], threading.Event()

        def stream():
            body = {"prompt": "hello", "max_tokens": 1000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
                for line in answer.iter_lines():
                    chunks.append(line)
                    first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(60)
        sent = time.monotonic()
        server.send_signal(signal.SIGINT)
        err = server.communicate(timeout=60)[1]
        client.join(30)
        assert server.returncode == 0 and time.monotonic() - sent < 10  # 2 s of grace, then shutdown
        assert "Traceback" not in err and "CancelledError" not in err
        assert err.strip().splitlines()[-1].startswith("moestream: stopped")
        assert "device tier:" in started and "policy lru" in started  # the start-up summary
        assert "request 1 finished (abort):" in err and "shut down after 1 request\n" in err
        data = [line[6:] for line in chunks if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
    finally:
        server.kill()


def _announced_url(server) -> tuple[str, str]:
    """The URL the server says it serves on, and what it printed before."""
    before = []
    for line in server.stderr:
        if "serving" in line and " on http://" in line:
            return line.rsplit(" on ", 1)[1].strip(), "".join(before)
        before.append(line)
    raise AssertionError("the server ended before it said where it serves")


def test_a_kv_budget_that_holds_no_request_is_refused_at_start_up(tiny_checkpoint, capsys):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    assert main(["serve", "--model", str(model), "--port", "0", "--buffered-io", "--kv-budget", "16B"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kv-budget" in err and "holds no request" in err and "serving" not in err
