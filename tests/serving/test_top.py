"""`moestream top` against a real server: one frame (--once) shows the heatmap's layers and every
figure; an unreachable server, a foreign host and a missing key are one line and exit 2."""

import httpx
import pytest

from moestream.cli import main
from moestream.serving.server import Server

KEY = "sk-top"


@pytest.fixture(scope="module")
def server(engine):
    with Server(engine, "tiny", api_key=KEY) as server:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60).status_code == 200
        yield server


def test_once_prints_one_frame_of_the_live_figures(server, capsys):
    assert main(["top", "--url", server.url, "--api-key", KEY, "--once"]) == 0
    out = capsys.readouterr().out
    for shown in ("layer   0", "layer   1", "recent steps", "device", "host", "precision", "recall",
                  "in flight", "late", "misses on host (off)", "from disk", "TTFT p50", "TPOT p99", "running",
                  "waiting"):
        assert shown in out
    assert "■" in out  # heatmap cells


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://127.0.0.1:1"], "cannot reach the server"),
    (["--url", "http://10.0.0.1:8000"], "only watches servers on this machine"),
])
def test_bad_addresses_are_one_line_and_exit_2(argv, message, capsys):
    assert main(["top", *argv, "--once"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_missing_key_is_one_line_and_exit_2(server, capsys):
    assert main(["top", "--url", server.url, "--once"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and len(err.strip().splitlines()) == 1
