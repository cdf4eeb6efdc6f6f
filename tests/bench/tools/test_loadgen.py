"""loadgen finds the named traces and the ShareGPT prompts under a data dir, reads both trace formats,
replays a small synthetic trace against a real server and reports what it measured."""

import json
import statistics

import pytest

from moestream.bench.tools.workload import TraceRequest, plan, prompt_texts, read_trace, trace_path
from moestream.cli import main
from moestream.runtime import Engine, EngineConfig
from moestream.serving.server import Server


@pytest.fixture(scope="module")
def serving_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen2_moe", num_layers=2)  # the serving tests' checkpoint


def _azure(path, rows):
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" +
                    "".join(f"2023-11-16 18:15:{s:02d}.5000000,{i},{o}\n" for s, i, o in rows))
    return path


def test_traces_are_read_relative_to_their_first_request(tmp_path):
    azure = read_trace(_azure(tmp_path / "t.csv", [(40, 30, 3), (42, 10, 2)]))
    assert azure == [TraceRequest(0.0, 30, 3), TraceRequest(2.0, 10, 2)]
    mooncake = tmp_path / "t.jsonl"
    mooncake.write_text('{"timestamp": 500, "input_length": 7, "output_length": 2}\n'
                        '{"timestamp": 2500, "input_length": 9, "output_length": 4}\n')
    assert read_trace(mooncake) == [TraceRequest(0.0, 7, 2), TraceRequest(2.0, 9, 4)]


# Two-line copies in the formats of ../shared/data/workloads (see its README), at the paths it uses,
# and the requests they hold: (arrival s, input tokens, output tokens).
NAMED = {
    "azure-conv": ("azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
                   "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:50.9951690,396,109\n", [(0.0, 374, 44), (4.314579, 396, 109)]),
    "azure-code": ("azure-llm-2023/AzureLLMInferenceTrace_code.csv",
                   "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
                   "2023-11-16 18:17:04.0319600,3180,8\n", [(0.0, 4808, 10), (0.052, 3180, 8)]),
    "mooncake": ("mooncake/conversation_trace.jsonl",
                 '{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}\n'
                 '{"timestamp": 1500, "input_length": 7322, "output_length": 490, "hash_ids": [0, 14]}\n',
                 [(0.0, 6758, 500), (1.5, 7322, 490)]),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_traces_are_found_under_the_data_dir(tmp_path, name):
    relative, text, expected = NAMED[name]
    path = tmp_path / "workloads" / relative
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert trace_path(name, tmp_path) == path
    requests = read_trace(trace_path(name, tmp_path))
    assert [(r.num_input_tokens, r.num_output_tokens) for r in requests] == [(i, o) for _, i, o in expected]
    assert [r.arrival_s for r in requests] == pytest.approx([t for t, _, _ in expected])


def test_prompts_are_the_first_turns_of_sharegpt(tmp_path):
    path = tmp_path / "workloads" / "sharegpt" / "ShareGPT_V3_filtered_1000.json"
    path.parent.mkdir(parents=True)
    conversations = [{"id": "a1", "conversations": [{"from": "human", "value": "What is a blog?"}]},
                     {"id": "b2", "conversations": []},
                     {"id": "c3", "conversations": [{"from": "human", "value": "Write a haiku."}]}]
    path.write_text(json.dumps(conversations))
    assert prompt_texts(tmp_path) == ["What is a blog?", "Write a haiku."]


def test_plan_takes_rate_times_duration_requests_at_the_rate_and_scales_lengths():
    trace = [TraceRequest(t, 100, 40) for t in (5.0, 6.0, 8.0, 9.0, 30.0)]
    planned = plan(trace, ["one two three"], rps=1.5, duration_s=2, scale_lengths=0.1, max_requests=10)
    assert [p.send_at_s for p in planned] == pytest.approx([0.0, 2 / 4.5, 2 / 1.5])  # 2 gaps at 1.5 req/s
    assert all(p.max_tokens == 4 and len(p.prompt.split()) == 8 for p in planned)
    assert len(plan(trace, ["x"], rps=10, duration_s=10, scale_lengths=1, max_requests=4)) == 4


def test_loadgen_against_a_live_server(serving_checkpoint, tmp_path, capsys):
    trace = _azure(tmp_path / "trace.csv", [(s, 40, 30) for s in range(0, 12, 1)])
    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        with Server(engine, "tiny") as server:
            code = main(["loadgen", "--url", server.url, "--trace", str(trace), "--rps", "4", "--duration", "2",
                         "--scale-lengths", "0.2", "--data-dir", str(tmp_path), "--json", str(tmp_path / "r.json"),
                         "--plot", str(tmp_path / "cdf.png")])
    assert code == 0
    figures = json.loads((tmp_path / "r.json").read_text())
    assert figures["num_requests"] == 8 and figures["num_completed"] == 8  # 4 req/s for 2 s
    assert figures["ttft_ms"]["p50"] > 0 and 0 <= figures["slo_attainment"] <= 1
    per_request = sorted(r["tpot_s"] * 1e3 for r in figures["requests"] if r["tpot_s"] is not None)
    assert 0 < figures["tpot_ms"]["p50"] <= figures["tpot_ms"]["p90"] <= figures["tpot_ms"]["p99"] <= per_request[-1]
    assert figures["tpot_ms"]["p50"] == pytest.approx(statistics.median(per_request))
    assert figures["throughput_rps"] == pytest.approx(figures["num_completed"] / figures["wall_s"])
    tokens = sum(r["num_tokens"] for r in figures["requests"])
    assert figures["throughput_tokens_per_s"] == pytest.approx(tokens / figures["wall_s"]) and tokens > 0
    assert (tmp_path / "cdf.png").stat().st_size > 0
    assert "req/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://example.com:80", "--trace", "azure-conv"], "this machine"),
    (["--url", "http://127.0.0.1:9", "--trace", "nowhere.csv"], "does not exist"),
])
def test_loadgen_refuses_remote_servers_and_missing_traces(tmp_path, capsys, argv, message):
    assert main(["loadgen", *argv, "--rps", "1", "--duration", "1", "--data-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_loadgen_fails_when_no_request_succeeds_and_counts_why(serving_checkpoint, tmp_path, capsys):
    trace = _azure(tmp_path / "trace.csv", [(s, 40, 30) for s in range(0, 4)])
    argv = ["--trace", str(trace), "--rps", "2", "--duration", "1", "--scale-lengths", "0.2",
            "--data-dir", str(tmp_path), "--drain-timeout", "5"]
    assert main(["loadgen", "--url", f"http://127.0.0.1:{_closed_port()}", *argv]) == 1
    out, err = capsys.readouterr()
    assert "0/2 requests" in out and "no answer x2 failed" in out and "no request succeeded" in err
    with Engine(serving_checkpoint, EngineConfig(expert_budget="0.5", direct_io=False)) as engine:
        with Server(engine, "tiny", api_key="right") as server:
            assert main(["loadgen", "--url", server.url, "--api-key", "wrong", *argv]) == 1
    assert "401 x2 failed" in capsys.readouterr().out
