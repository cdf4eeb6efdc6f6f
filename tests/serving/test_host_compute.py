"""A server whose engine computes device-tier misses on the host (--host-compute, issue 48): the live figures
(/v1/moestream/stats, the dashboard's source), the Prometheus metrics and the logs give the share of
misses computed on the host, counted from the engine's own count."""

import logging
import time

import httpx
import pytest

from moestream.runtime import Engine, EngineConfig
from moestream.serving import logs
from moestream.serving.server import Server
from moestream.serving.worker import EngineWorker

KEY = "sk-host"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def host_engine(serving_checkpoint):
    config = EngineConfig(expert_budget="0.25", host_budget="1.0", host_compute="share:1", direct_io=False)
    with Engine(serving_checkpoint, config) as engine:
        yield engine


def _metrics(server) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in httpx.get(server.url + "/metrics", timeout=10).text
            .splitlines() if line and not line.startswith("#")}


def _settled(server, body: dict) -> tuple[dict, dict[str, float]]:
    """The live figures and metrics once the request's steps are counted (the answer may come first)."""
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        stats = httpx.get(f"{server.url}/v1/moestream/stats", headers=AUTH, timeout=10).json()
        if stats["tokens"] == len(body["prompt"]) + body["max_tokens"] - 1 or time.monotonic() > deadline:
            return stats, _metrics(server)
        time.sleep(0.05)


def test_the_live_figures_and_metrics_give_the_misses_computed_on_the_host(host_engine):
    with Server(host_engine, "tiny", api_key=KEY) as server:
        stats, metrics = _settled(server, {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0})
    host = stats["host_compute"]
    assert host["rule"] == "share:1" and host["experts"] > 0
    misses = metrics['moestream_expert_lookups_total{result="miss",tier="device"}']
    assert host["share"] == pytest.approx(host["experts"] / (host["experts"] + misses)) and host["share"] > 0  # cold: the first misses come from disk
    assert metrics["moestream_experts_host_computed_total"] == host["experts"]
    assert metrics["moestream_host_compute_share"] == pytest.approx(host["share"])


def test_a_server_without_host_compute_says_so(engine):
    with Server(engine, "tiny", api_key=KEY) as server:
        stats, metrics = _settled(server, {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert stats["host_compute"]["rule"] == "off" and stats["host_compute"]["experts"] == 0
    assert metrics["moestream_experts_host_computed_total"] == 0
    assert stats["host_compute"]["share"] in (0.0, None)  # None: nothing missed


def test_the_logs_name_the_rule_and_the_periodic_line_the_share(host_engine, caplog):
    caplog.set_level(logging.INFO, "moestream.serve")
    logs.startup(host_engine)
    assert "host compute share:1: a device-tier miss held in the host tier may compute there, on 1 host thread" \
        in caplog.text
    worker = EngineWorker(host_engine)
    try:
        assert worker._periodic.host_compute
    finally:
        worker.close()


def test_the_dashboard_draws_the_share_beside_the_hit_rate(engine):
    with Server(engine, "tiny", api_key=KEY) as server:
        page = httpx.get(f"{server.url}/dashboard", timeout=10).text
    assert '"misses on host (" + host.rule + ")", pct(host.share)' in page
