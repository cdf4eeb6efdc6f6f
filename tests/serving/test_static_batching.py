"""An encoder-decoder model (Switch) served through a real server: static batches, each streamed
answer equal to offline generate, concurrent clients batched together, cancellation mid-stream."""

import asyncio
import json

import httpx
import pytest

from moestream import LLM, SamplingParams
from moestream.config import BatchingConfig
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.scheduling.scheduler import StaticBatches
from moestream.serving.server import Server
from moestream.serving.worker import WorkerConfig

PROMPTS = ["The cat sat on", "Experts route tokens", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def switch_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("switch_transformers", num_layers=2)


@pytest.fixture(scope="module")
def server(switch_checkpoint):
    with Engine(switch_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        config = WorkerConfig(max_wait_ms=200.0, batching=BatchingConfig(max_batch_size=4))
        with Server(engine, "switch", worker_config=config) as server:
            yield server


def test_the_worker_batches_an_encoder_decoder_statically(server):
    assert isinstance(server.worker.batcher.scheduler.rule, StaticBatches)


def test_concurrent_streamed_answers_equal_offline_generate(server, switch_checkpoint):
    params = [SamplingParams(max_tokens=3 + i, temperature=0.7 * (i % 2), seed=i) for i in range(len(PROMPTS))]

    async def ask(client, prompt, p):
        body = {"prompt": prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed,
                "stream": True}
        text, reasons = "", []
        async with client.stream("POST", "/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    text += choice["text"]
                    reasons.append(choice["finish_reason"])
        return text, reasons[-1]

    async def everyone():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(ask(client, prompt, p) for prompt, p in zip(PROMPTS, params)))

    served = asyncio.run(everyone())
    with LLM(switch_checkpoint, expert_budget="0.5", direct_io=False) as llm:
        offline = [llm.generate(prompt, p)[0] for prompt, p in zip(PROMPTS, params)]
    assert served == [(o.text, o.finish_reason) for o in offline]
    metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(server.url + "/metrics").text.splitlines()
               if line.startswith("moestream_batch_size_")}
    assert metrics["moestream_batch_size_sum"] / metrics["moestream_batch_size_count"] > 1  # clients shared batches


def test_a_client_leaving_mid_stream_ends_its_row_and_the_server_goes_on(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 1.0, "seed": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        assert next(line for line in stream.iter_lines() if line.startswith("data: "))
    for _ in range(200):
        if server.worker.num_running == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert server.worker.num_running == 0  # the batch ended long before 400 tokens
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Next", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
