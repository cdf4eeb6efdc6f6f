"""A real server on loopback: OpenAI-shaped answers, streaming, concurrency, cancellation, errors,
the API key, and nothing left running after shutdown."""

import asyncio
import json
import threading

import httpx
import pytest

from moestream import LLM, SamplingParams
from moestream.config import BatchingConfig
from moestream.contracts import Observer
from moestream.serving.server import Server
from moestream.serving.worker import WorkerConfig

KEY = "sk-test"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Ends(Observer):
    def __init__(self):
        self.ended = []

    def end_sequence(self, seq_id):
        self.ended.append(seq_id)


@pytest.fixture
def server(engine):
    with Server(engine, MODEL, api_key=KEY, worker_config=WorkerConfig(max_queue=40, batching=BatchingConfig(max_batch_size=8))) as server:
        yield server


def _post(server, path, body, headers=AUTH, **kwargs):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kwargs)


def _events(lines) -> list[dict]:
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_alone_equals_offline_generate(server, serving_checkpoint):
    body = {"model": MODEL, "prompt": "The cat sat on", "max_tokens": 6, "temperature": 0.8, "seed": 5}
    answer = _post(server, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    with LLM(serving_checkpoint, expert_budget="0.5", direct_io=False) as llm:
        offline = llm.generate("The cat sat on", SamplingParams(max_tokens=6, temperature=0.8, seed=5))[0]
    assert choice["text"] == offline.text and choice["finish_reason"] == offline.finish_reason
    assert answer.json()["usage"]["completion_tokens"] == len(offline.token_ids)


def test_streamed_text_equals_the_whole_answer(server):
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True},
                      headers=AUTH, timeout=60) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        chunks = _events(stream.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert all(c["object"] == "text_completion" for c in chunks)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "def add(a, b):"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_include_usage_adds_a_last_chunk_with_the_usage(server, path, body):
    body = body | {"max_tokens": 5, "temperature": 0, "stream": True}
    whole = _post(server, path, body | {"stream": False}).json()
    with httpx.stream("POST", server.url + path, json=body | {"stream_options": {"include_usage": True}},
                      headers=AUTH, timeout=60) as stream:
        chunks = _events(stream.iter_lines())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all("usage" not in c for c in chunks[:-1]) and chunks[-2]["choices"][0]["finish_reason"]
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=60) as stream:
        assert all("usage" not in c for c in _events(stream.iter_lines()))


def test_a_streamed_stop_string_is_trimmed_like_the_whole_answer(server):
    body = {"prompt": "The cat sat on", "max_tokens": 12, "temperature": 0}
    full = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    if len(full) < 4:
        pytest.skip("the random model ended too early to pick a stop string")
    body |= {"stop": [full[2:4]]}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True},
                      headers=AUTH, timeout=60) as stream:
        chunks = _events(stream.iter_lines())
    assert whole["text"] == full[: full.find(full[2:4])] and whole["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_chat_streams_deltas_with_a_role_first(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as stream:
        chunks = _events(stream.iter_lines())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    whole = _post(server, "/v1/chat/completions", body | {"stream": False}).json()
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_32_concurrent_clients_get_what_they_would_get_alone(server):
    prompts = [f"Request number {i} says" for i in range(32)]
    lengths = [3 + i % 5 for i in range(32)]  # sequences leave at different steps, others join

    async def ask(client, prompt, max_tokens):
        answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        return answer.status_code, answer.json()["choices"][0]["text"]

    async def everyone():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(*(ask(client, p, n) for p, n in zip(prompts, lengths)))

    answers = asyncio.run(everyone())
    assert all(status == 200 for status, _ in answers)
    alone = [_post(server, "/v1/completions", {"prompt": p, "max_tokens": n, "temperature": 0}).json()["choices"][0]["text"]
             for p, n in zip(prompts, lengths)]
    assert [text for _, text in answers] == alone
    metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
               if line.startswith("moestream_batch_size_")}
    assert metrics["moestream_batch_size_sum"] / metrics["moestream_batch_size_count"] > 1  # steps were shared


def _settled(server, expected: str) -> str:
    """The /metrics text once it holds expected (or after 10 s)."""
    for _ in range(200):
        metrics = httpx.get(server.url + "/metrics").text
        if expected in metrics:
            break
        threading.Event().wait(0.05)
    return metrics


def test_a_client_leaving_mid_stream_cancels_its_sequence(server, engine):
    ends = Ends()
    engine.add_observer(ends)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 1.0, "seed": 1, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert "moestream_running_sequences 1.0" in httpx.get(server.url + "/metrics").text
        metrics = _settled(server, 'moestream_requests_total{finish_reason="abort"} 1.0')
    finally:
        engine.remove_observer(ends)
    assert 'moestream_requests_total{finish_reason="abort"} 1.0' in metrics
    assert "moestream_running_sequences 0.0" in metrics and "moestream_kv_reserved_bytes 0.0" in metrics
    assert len(ends.ended) == 1  # the policy's per-sequence state was ended
    assert server.worker.num_running == 0


def _threads() -> set[threading.Thread]:
    """Live threads, less the store's reader pool (the engine's own, bounded, started on demand)."""
    return {t for t in threading.enumerate() if not t.name.startswith("moestream-io")}


def test_a_run_leaves_no_tasks_threads_or_running_sequences(engine):
    threads = _threads()
    observers = list(engine.driver.observers)
    streamed = {"prompt": "Leak check", "max_tokens": 300, "temperature": 1.0, "seed": 2, "stream": True}

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=streamed) as stream:  # left mid-way
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        break
            await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3})
                                   for i in range(6)))

    with Server(engine, MODEL) as server:
        idle = server.tasks()
        asyncio.run(run(server.url))
        metrics = _settled(server, "moestream_running_sequences 0.0")
        for _ in range(100):
            if server.tasks() == idle:
                break
            threading.Event().wait(0.05)
        assert server.tasks() == idle
        assert "moestream_running_sequences 0.0" in metrics and "moestream_queue_depth 0.0" in metrics
        assert server.worker.batcher.scheduler.reserved_bytes == 0
    assert _threads() <= threads
    assert engine.driver.observers == observers  # the batcher's routing-path observer left with it


@pytest.mark.parametrize("stream", [False, True])
def test_a_fresh_server_answers_a_request_over_the_kv_budget_400(engine, stream):
    """The first request a server sees is held to the budget, and refused with a status, streamed or not."""
    config = WorkerConfig(batching=BatchingConfig(kv_budget_bytes=4096))
    with Server(engine, MODEL, worker_config=config) as server:
        body = {"prompt": "x", "max_tokens": 500, "stream": stream}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as answer:
            answer.read()
        small = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "kv_budget_exceeded"
    assert small.status_code == 200  # the budget is not refusing everything


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_waiting_too_long_for_room_is_a_503(engine, stream):
    config = WorkerConfig(max_wait_ms=0, max_queue_wait_ms=50, batching=BatchingConfig(max_batch_size=1))
    running = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 1.0, "seed": 1, "stream": True}
    with Server(engine, MODEL, worker_config=config) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json=running, timeout=60) as first:
            lines = first.iter_lines()  # kept: a dropped line iterator closes the stream
            assert next(line for line in lines if line.startswith("data: "))  # it holds the one place
            body = {"prompt": "x", "max_tokens": 2, "stream": stream}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as late:
                late.read()
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "overloaded" and late.json()["error"]["type"] == "server_error"


def test_a_client_leaving_while_its_request_waits_for_room_cancels_it(engine):
    config = WorkerConfig(max_wait_ms=0, batching=BatchingConfig(max_batch_size=1))
    running = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 1.0, "seed": 1, "stream": True}
    with Server(engine, MODEL, worker_config=config) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json=running, timeout=60) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it holds the one place
            with pytest.raises(httpx.TimeoutException):  # a streamed request's answer begins once admitted
                httpx.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=0.3)
            metrics = _settled(server, 'moestream_requests_total{finish_reason="abort"} 1.0')
    assert 'moestream_requests_total{finish_reason="abort"} 1.0' in metrics  # dropped from the queue


def test_a_client_leaving_before_a_whole_answer_cancels_its_sequence(server):
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 1.0, "seed": 1}  # 330 tokens to EOS
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.2)
    for _ in range(200):
        metrics = httpx.get(server.url + "/metrics").text
        if 'moestream_requests_total{finish_reason="abort"} 1.0' in metrics:
            break
        threading.Event().wait(0.05)
    assert 'moestream_requests_total{finish_reason="abort"} 1.0' in metrics, [
        line for line in metrics.splitlines() if line.startswith(("moestream_requests_total", "moestream_generated_tokens_total"))]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -2}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 7}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"prompt": "x", "n": 3}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400),
    ("/v1/completions", {"prompt": [10**7]}, 400),
    ("/v1/completions", {"prompt": "word " * 2000, "max_tokens": 4}, 400),
    ("/v1/completions", {"max_tokens": 4}, 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/completions", {"prompt": "x", "top_k": -1}, 400),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400),
    ("/v1/completions", {"prompt": []}, 400),
])
def test_bad_requests_get_openai_errors(server, path, body, status):
    answer = _post(server, path, body)
    assert answer.status_code == status, answer.text
    assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}
    if "logprobs" in body or "top_logprobs" in body:
        assert "not supported" in answer.json()["error"]["message"]


def test_malformed_json_is_a_400(server):
    answer = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=AUTH | {"content-type": "application/json"})
    assert answer.status_code == 400 and "error" in answer.json()


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("stream", 1), ("ignore_eos", "true"),
                                          ("stream_options", {"include_usage": "no"})])
def test_a_switch_that_is_not_a_boolean_is_a_400(server, field, value):
    answer = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value})
    assert answer.status_code == 400 and field in answer.json()["error"]["message"]


def test_an_empty_api_key_is_refused_not_taken_for_none(engine):
    from moestream.errors import MoestreamError

    with pytest.raises(MoestreamError, match="empty API key"):
        Server(engine, MODEL, api_key="")


def test_the_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = _post(server, "/v1/completions", {"prompt": "x"}, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_a_streamed_request_needs_the_api_key_too(server, path, body, headers):
    with httpx.stream("POST", server.url + path, json=body | {"stream": True}, headers=headers, timeout=60) as answer:
        answer.read()
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert "moestream_generated_tokens_total 0.0" in httpx.get(server.url + "/metrics").text  # nothing was generated


def test_a_full_queue_answers_429(engine):
    config = WorkerConfig(max_queue=1, max_wait_ms=0, batching=BatchingConfig(max_batch_size=1))
    body = {"prompt": "Busy busy", "max_tokens": 30, "temperature": 0}

    async def flood(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    with Server(engine, MODEL, worker_config=config) as server:
        statuses = [a.status_code for a in asyncio.run(flood(server.url))]
        assert 429 in statuses and 200 in statuses
        assert "moestream_rejected_requests_total" in httpx.get(server.url + "/metrics").text


def test_metrics_report_latency_and_experts(server):
    _post(server, "/v1/completions", {"prompt": "Metrics please", "max_tokens": 3, "temperature": 0})
    text = httpx.get(server.url + "/metrics").text
    for name in ("moestream_ttft_seconds_bucket", "moestream_tpot_seconds_bucket", "moestream_queue_depth",
                 'moestream_expert_lookups_total{result="miss",tier="device"}', "moestream_expert_bytes_moved_total",
                 "moestream_prefetch_precision", "moestream_prefetch_recall"):
        assert name in text


def test_no_threads_are_left_after_shutdown(engine):
    before = _threads()
    with Server(engine, MODEL) as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "bye", "max_tokens": 2}, timeout=60)
    assert _threads() <= before


def test_a_closed_server_leaves_its_engine_to_the_garbage_collector(serving_checkpoint):
    """FastAPI caches what it learns of every endpoint function for the process's life: routes that closed
    over the worker kept each engine served (its expert slots: hundreds of MiB) alive."""
    import gc
    import weakref

    from moestream.runtime import Engine, EngineConfig

    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        with Server(engine, "tiny", api_key="k") as served:
            answer = httpx.post(served.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                headers={"Authorization": "Bearer k"}, timeout=60)
            assert answer.status_code == 200 and httpx.get(served.url + "/metrics").status_code == 200
        engines = [weakref.ref(engine), weakref.ref(served.worker)]
    del engine, served, answer
    gc.collect()
    assert [ref() for ref in engines] == [None, None]
