"""The HTTP front end: chat prompts follow the checkpoint's chat template (a plain default without
one), and every answer, the last streamed chunk, /v1/models and /health say whether routing is replayed."""

import json
import shutil

import httpx
import pytest

from moestream.runtime import Engine, EngineConfig
from moestream.serving.app import Frontend
from moestream.serving.protocol import ChatBody
from moestream.serving.server import Server
from moestream.serving.worker import EngineWorker

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _chat_prompt(checkpoint) -> str:
    with Engine(checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        worker = EngineWorker(engine)
        try:
            return Frontend(worker, "tiny").chat_prompt(ChatBody(messages=MESSAGES))
        finally:
            worker.close()


def test_a_checkpoint_without_a_chat_template_gets_role_lines(serving_checkpoint):
    assert _chat_prompt(serving_checkpoint) == "system: Be brief.\nuser: Hello\nassistant:"


def test_a_checkpoint_s_chat_template_builds_the_chat_prompt(serving_checkpoint, tmp_path):
    checkpoint = shutil.copytree(serving_checkpoint, tmp_path / "templated")
    config_path = checkpoint / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"chat_template": TEMPLATE}))
    assert _chat_prompt(checkpoint) == "<|system|>Be brief.\n<|user|>Hello\n<|assistant|>"


def _events(lines) -> list[dict]:
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("replayed", [False, True])
def test_answers_say_whether_the_routing_is_replayed(serving_checkpoint, replay_trace, replayed):
    config = EngineConfig(expert_budget="0.5", direct_io=False, replay_routing=str(replay_trace) if replayed else None)
    body = {"prompt": "Label me", "max_tokens": 3, "temperature": 0}
    with Engine(serving_checkpoint, config) as engine, Server(engine, "tiny") as server:
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3},
                          timeout=60).json()
        with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as stream:
            chunks = _events(stream.iter_lines())
        models, health = httpx.get(server.url + "/v1/models").json(), httpx.get(server.url + "/health").json()
    label = {"replayed": replayed}
    assert whole["moestream"] == label and chat["moestream"] == label and "usage" in whole
    assert chunks[-1]["moestream"] == label and chunks[-1]["choices"][0]["finish_reason"] is not None
    assert not any("moestream" in c for c in chunks[:-1])
    assert models["data"][0]["moestream"] == label and health == {"status": "ok", "moestream": label}


def test_a_request_to_a_stopped_engine_thread_gets_503_not_a_hang(serving_checkpoint):
    body = {"prompt": "Anyone there?", "max_tokens": 2}
    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine, \
            Server(engine, "tiny") as server:
        server.worker._stop.set()  # the engine thread ends as if it had died: nothing would answer
        server.worker._thread.join(10)
        for stream in (False, True):
            answer = httpx.post(server.url + "/v1/completions", json=body | {"stream": stream}, timeout=30)
            assert answer.status_code == 503 and "not running" in answer.json()["error"]["message"]
