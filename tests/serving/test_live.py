"""The live figures (serving/live.py) of a real server after a known run, as /v1/moestream/stats
serves them: the heatmap's lookups add up to the store's, one row per engine iteration, and the
rates follow from the store's counters."""

import time

import httpx
import pytest

from moestream.serving.server import Server

KEY = "sk-live"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(engine):
    with Server(engine, "tiny", api_key=KEY) as server:
        body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert answer.status_code == 200
        yield server, _settled(server, engine)


def _stats(server) -> dict:
    answer = httpx.get(f"{server.url}/v1/moestream/stats", headers=AUTH, timeout=10)
    assert answer.status_code == 200
    return answer.json()


def _settled(server, engine) -> dict:
    """The figures once the last step's lookups are counted (the answer may come before they are)."""
    deadline = time.monotonic() + 10
    while True:
        stats, store = _stats(server), engine.store.stats()
        counted = sum(map(sum, stats["heatmap"]["lookups"]))
        if counted == store.hits + store.misses or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_the_heatmap_has_a_row_per_iteration_and_the_stores_lookups(served, engine):
    _, stats = served
    store = engine.store.stats()
    heatmap = stats["heatmap"]
    assert stats["layers"] == 2
    assert len(heatmap["steps"]) == 4  # the prompt's prefill, then three decode steps
    assert sum(map(sum, heatmap["lookups"])) == store.hits + store.misses > 0
    assert all(n > 0 for row in heatmap["lookups"] for n in row)  # every layer looks experts up every step
    hits = sum(rate * n for rates, ns in zip(heatmap["hit_rate"], heatmap["lookups"]) for rate, n in zip(rates, ns))
    assert hits == pytest.approx(store.hits)
    assert stats["hit_rate"] == pytest.approx(store.hits / (store.hits + store.misses))


def test_tokens_bytes_and_prediction_follow_from_the_run(served, engine):
    _, stats = served
    store = engine.store.stats()
    assert stats["tokens"] == 5 + 3  # the prompt, then one token per decode step
    assert stats["bytes_per_token"]["disk"] == pytest.approx(store.bytes_read["disk"] / 8)
    prediction = stats["prediction"]
    assert prediction["prefetched"] == store.prefetched and prediction["used"] == store.prefetch_hits
    if store.prefetched:
        assert prediction["precision"] == pytest.approx(store.prefetch_hits / store.prefetched)
    assert prediction["recall"] == pytest.approx(store.prefetch_hits / (store.hits + store.misses))


def test_tiers_transfers_latency_and_queue(served, engine):
    _, stats = served
    device = stats["tiers"]["device"]
    assert device["total"] == engine.store.device_slots and 0 < device["used"] <= device["total"]
    assert stats["tiers"]["host"]["total"] == engine.store.host_slots
    assert stats["transfers"]["late"] == engine.store.stats().late >= 0
    assert stats["latency_s"]["ttft"]["count"] == 1 and stats["latency_s"]["ttft"]["p50"] > 0
    assert stats["latency_s"]["tpot"]["count"] == 1
    assert stats["requests"] == {"running": 0, "waiting": 0}


def test_the_stats_need_the_key_and_the_page_does_not(served):
    server, _ = served
    assert httpx.get(f"{server.url}/v1/moestream/stats", timeout=10).status_code == 401
    page = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert page.status_code == 200 and "/v1/moestream/stats" in page.text and "<canvas" in page.text
