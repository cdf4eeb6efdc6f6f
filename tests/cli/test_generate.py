"""`moestream generate`: prints the text, writes the JSON other tools read, fails with one line."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import moestream
from moestream.cli import main
from moestream.runtime import Engine, EngineConfig
from moestream.trace.format import load_trace

PROMPT = "The experts are"
PROMPTS = ["The experts are", "Once upon a time", "Mixture of experts route every token to", "def f(x):"]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2_moe", num_layers=2, max_shard_bytes=300_000)  # several shards and an index


def _error_line(capsys) -> str:
    return _error_line_of(capsys.readouterr().err)


def _error_line_of(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("compute uses ")]  # start-up
    assert len(lines) == 1 and "Traceback" not in lines[0]
    return lines[0]


def test_generate_prints_text_and_writes_json(model_dir, tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "5",
                 "--expert-budget", "0.3", "--buffered-io", "--json", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    with Engine(model_dir, EngineConfig(expert_budget="1.0", direct_io=False)) as engine:
        expected = engine.generate([PROMPT], max_new_tokens=5)
    assert record["token_ids"] == expected.token_ids[0]
    assert record["text"] == expected.texts[0]
    assert capsys.readouterr().out.rstrip("\n") == expected.texts[0]
    assert record["expert_misses"] > 0 and record["bytes_read"]["disk"] > 0
    assert set(record) >= {"ttft_ms", "tpot_ms", "expert_hits", "expert_misses", "bytes_read"}
    assert [p.name for p in out.parent.iterdir()] == ["run.json"]


def test_generate_records_the_routing_trace(model_dir, tmp_path):
    path = tmp_path / "trace.npz"
    code = main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--buffered-io", "--record-trace", str(path)])
    assert code == 0
    trace = load_trace(path)
    with Engine(model_dir, EngineConfig(direct_io=False)) as engine:
        prompt_ids = engine.encode(PROMPT)
    assert trace.num_tokens == len(prompt_ids) + 3  # the last generated token is never fed back
    assert trace.token_ids[: len(prompt_ids)].tolist() == prompt_ids
    assert trace.is_prefill.sum() == len(prompt_ids)
    assert trace.gate_probs is not None and trace.gate_weights is not None
    assert list(trace.texts.values()) == [PROMPT]


def _prompts_file(tmp_path, lines) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _expected_batches(model_dir, batch_size: int) -> list[list[int]]:
    with Engine(model_dir, EngineConfig(expert_budget="1.0", direct_io=False)) as engine:
        batches = [PROMPTS[i: i + batch_size] for i in range(0, len(PROMPTS), batch_size)]
        return [ids for batch in batches for ids in engine.generate(batch, max_new_tokens=4).token_ids]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_prompts_file_runs_every_prompt(model_dir, tmp_path, capsys, batch_size):
    prompts = _prompts_file(tmp_path, [PROMPTS[0], "", "   ", *PROMPTS[1:]])
    out = tmp_path / "runs.json"
    code = main(["generate", "--model", str(model_dir), "--prompts-file", prompts, "--max-new-tokens", "4",
                 "--batch-size", str(batch_size), "--buffered-io", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["token_ids"] for r in records] == _expected_batches(model_dir, batch_size)
    assert [r["batch"] for r in records] == [i // batch_size for i in range(len(PROMPTS))]
    printed = capsys.readouterr().out
    assert all(r["text"] in printed for r in records) and f"prompt 4/{len(PROMPTS)}" in printed


def test_a_prompts_file_records_one_trace_of_all_prompts(model_dir, tmp_path):
    path = tmp_path / "trace.npz"
    code = main(["generate", "--model", str(model_dir), "--prompts-file", _prompts_file(tmp_path, PROMPTS),
                 "--max-new-tokens", "3", "--batch-size", "2", "--buffered-io",
                 "--record-trace", str(path), "--record-hidden"])
    assert code == 0
    trace = load_trace(path)
    bounds = trace.sequence_bounds()
    assert [trace.texts[seq] for seq, _, _ in bounds] == PROMPTS
    with Engine(model_dir, EngineConfig(direct_io=False)) as engine:
        prompt_ids = [engine.encode(p) for p in PROMPTS]
    for (_, start, end), ids in zip(bounds, prompt_ids):
        assert trace.token_ids[start: start + len(ids)].tolist() == ids
        assert end - start <= len(ids) + 2 and trace.is_prefill[start:end].sum() == len(ids)
        assert np.array_equal(trace.positions[start:end], np.arange(end - start))
    for name in ("gate_probs", "hidden", "embeddings", "tokens"):
        assert getattr(trace, name) is not None, name


def test_without_record_hidden_the_trace_has_no_router_inputs(model_dir, tmp_path):
    path = tmp_path / "trace.npz"
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "2",
                 "--buffered-io", "--record-trace", str(path)]) == 0
    trace = load_trace(path)
    assert trace.hidden is None and trace.embeddings is None


def _empty(tmp_path):
    return _prompts_file(tmp_path, ["", "  "]), "no prompts"


def _missing(tmp_path):
    return str(tmp_path / "absent.txt"), "absent.txt"


def _not_text(tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00bad")
    return str(path), "binary.txt"


@pytest.mark.parametrize("make", [_empty, _missing, _not_text])
def test_a_bad_prompts_file_is_one_error_line(model_dir, tmp_path, capsys, make):
    prompts, expected = make(tmp_path)
    assert main(["generate", "--model", str(model_dir), "--prompts-file", prompts]) == 2
    assert expected in _error_line(capsys)


def test_a_bad_batch_size_is_one_error_line(model_dir, tmp_path, capsys):
    prompts = _prompts_file(tmp_path, PROMPTS)
    assert main(["generate", "--model", str(model_dir), "--prompts-file", prompts, "--batch-size", "0"]) == 2
    assert "batch-size" in _error_line(capsys)


@pytest.mark.parametrize("flags", [[], ["--prompt", PROMPT, "--prompts-file", "p.txt"]])
def test_exactly_one_prompt_source_is_required(model_dir, flags):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(model_dir), *flags])
    assert exit_.value.code == 2


def _shard(path):
    return sorted(path.glob("*.safetensors"))[-1]


def _truncate(path):
    shard = _shard(path)
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard.name


def _missing_shard(path):
    shard = _shard(path)
    shard.unlink()
    return shard.name


def _unsupported(path):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    return f"'llama' has no MoE experts in transformers {transformers.__version__}"


def _garbage(path):
    _shard(path).write_bytes(b"not a safetensors file at all")
    return _shard(path).name


@pytest.mark.parametrize("damage", [_truncate, _missing_shard, _unsupported, _garbage])
def test_a_damaged_checkpoint_is_one_error_line(model_dir, tmp_path, capsys, damage):
    path = shutil.copytree(model_dir, tmp_path / "damaged")
    named = damage(path)
    assert main(["generate", "--model", str(path), "--prompt", PROMPT]) == 2
    assert named in _error_line(capsys)


@pytest.mark.parametrize("flags, expected", [
    (["--expert-budget", "lots"], "budget"),
    (["--expert-budget", "1B"], "minimum"),
    (["--expert-budget", "1"], "--expert-budget: '1' has no unit"),
    (["--chunk-size", "-5"], "--chunk-size: cannot read '-5'"),
    (["--policy", "nope"], "nope"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--device", "tpu"], "tpu"),
    (["--chunks-in-flight", "0"], "chunks-in-flight"),
])
def test_bad_flags_are_one_error_line(model_dir, capsys, flags, expected):
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, *flags]) == 2
    assert expected in _error_line(capsys)


def test_a_missing_model_directory_is_named(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["generate", "--model", str(missing), "--prompt", PROMPT]) == 2
    assert str(missing) in _error_line(capsys)


def test_trace_recording_needs_a_decoder_only_model(tiny_checkpoint, tmp_path, capsys):
    path = tiny_checkpoint("switch_transformers", num_layers=2)
    args = ["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "2", "--buffered-io"]
    assert main([*args, "--record-trace", str(tmp_path / "t.npz")]) == 2
    assert "decoder-only" in _error_line(capsys)
    assert main(args) == 0


def test_generate_streams_the_text_and_summarises_on_stderr(model_dir, monkeypatch, capsys):
    printed_during_generation = []
    real = Engine.generate

    def watched(self, prompts, max_new_tokens=32, on_tokens=None):
        def spy(new):
            on_tokens(new)
            printed_during_generation.append(capsys.readouterr().out)
        return real(self, prompts, max_new_tokens, spy)

    monkeypatch.setattr(Engine, "generate", watched)
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--buffered-io"]) == 0
    captured = capsys.readouterr()
    with Engine(model_dir, EngineConfig(direct_io=False)) as engine:
        expected = real(engine, [PROMPT], 6).texts[0]
    assert ("".join(printed_during_generation) + captured.out).rstrip("\n") == expected
    assert sum(1 for chunk in printed_during_generation if chunk) >= 2  # text appeared before the end
    summary = captured.err.strip().splitlines()[-1]
    assert summary.startswith("6 tokens, TTFT ") and "TPOT" in summary and "expert hit rate" in summary
    assert "from disk" in summary
    figures = dict(re.findall(r"(TTFT|TPOT|prompt|generation) ([\d.]+)", summary))
    assert float(figures["generation"]) == pytest.approx(1e3 / float(figures["TPOT"]), rel=0.05)  # 5 decode steps; TPOT is printed to 0.1 ms
    assert float(figures["prompt"]) > 0


def test_ctrl_c_keeps_the_text_already_printed(model_dir, monkeypatch, capsys):
    real = Engine.generate

    def interrupted(self, prompts, max_new_tokens=32, on_tokens=None):
        steps = []

        def stop_after_three(new):
            on_tokens(new)
            steps.append(new)
            if len(steps) == 3:
                raise KeyboardInterrupt
        return real(self, prompts, max_new_tokens, stop_after_three)

    monkeypatch.setattr(Engine, "generate", interrupted)
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "8",
                 "--buffered-io"]) == 130
    captured = capsys.readouterr()
    with Engine(model_dir, EngineConfig(direct_io=False)) as engine:
        expected = real(engine, [PROMPT], 3).texts[0]
    assert captured.out.rstrip("\n") == expected and "interrupted" in captured.err


def _run_cli(*args: str) -> tuple[int, bool, str]:
    """(exit code, whether torch was imported, stderr) of the CLI in a fresh interpreter."""
    code = ("import sys; from moestream.cli import main; code = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.strip().endswith("True"), done.stderr.strip()


@pytest.mark.parametrize("args, message", [
    (("generate", "--model", "/no/such/dir", "--prompt", "hi"), "does not exist"),
    (("generate", "--model", ".", "--prompt", "hi"), "no config.json"),
    (("generate", "--model", "pyproject.toml", "--prompt", "hi"), "is a file: pass the checkpoint's directory"),
    (("generate", "--model", "/no/such/dir", "--prompt", "hi", "--expert-budget", "12XB"), "unknown size unit"),
    (("demo", "--host-budget", "lots"), "--host-budget: cannot read 'lots'"),
    (("verify", "--model", "/no/such/dir"), "does not exist"),
])
def test_bad_paths_and_budgets_are_refused_before_torch_is_imported(args, message):
    code, imported_torch, err = _run_cli(*args)
    assert code == 2 and not imported_torch and message in err and len(err.splitlines()) == 1


def _run_cli_modules(*args: str, cwd=None) -> tuple[int, set[str], str]:
    """(exit code, which of torch and the engine were imported, stderr) of the CLI in a fresh interpreter."""
    code = ("import sys; from moestream.cli import main; code = main(sys.argv[1:]); "
            "print(sorted(name for name in ('torch', 'moestream.runtime.engine') if name in sys.modules)); "
            "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    return done.returncode, set(json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))), done.stderr.strip()


@pytest.mark.parametrize("flags, message", [
    (["--policy", "nosuch"], "unknown --policy 'nosuch'"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--device", "cuda:abc"], "unknown --device 'cuda:abc'"),
    (["--horizon-layers", "-1"], "--horizon-layers must be >= 0"),
    (["--transfer-timeout-s", "-1"], "--transfer-timeout-s must be > 0"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--prompt", ""], "--prompt is empty"),
    (["--json", "/no/such/folder/out.json"], "--json /no/such/folder/out.json: folder /no/such/folder does not exist"),
    (["--record-trace", "/no/such/folder/t.npz"], "folder /no/such/folder does not exist"),
])
def test_every_engine_flag_is_refused_before_torch_is_imported(model_dir, flags, message):
    code, imported, err = _run_cli_modules("generate", "--model", str(model_dir), "--prompt", PROMPT, *flags)
    assert code == 2 and not imported and message in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_before_torch_is_imported_where_no_driver_is_present(model_dir):
    code, imported, err = _run_cli_modules("generate", "--model", str(model_dir), "--prompt", PROMPT,
                                           "--device", "cuda")
    assert code == 2 and "--device 'cuda' requested but CUDA is not available" in err and len(err.splitlines()) == 1
    assert "moestream.runtime.engine" not in imported


@pytest.mark.parametrize("budget", ["0", "1KiB"])
def test_a_budget_too_small_for_the_checkpoint_is_refused_before_the_model_loads(model_dir, budget):
    code, imported, err = _run_cli_modules("generate", "--model", str(model_dir), "--prompt", PROMPT,
                                           "--expert-budget", budget)
    assert code == 2 and "minimum" in err and len(err.splitlines()) == 1
    assert "moestream.runtime.engine" not in imported


def test_an_output_into_a_missing_folder_creates_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "missing" / "out.json"
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--json", str(out)]) == 2
    assert str(out.parent) in _error_line(capsys) and not out.parent.exists()


def test_the_threads_line_says_what_compute_uses_and_threads_takes_t(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "2",
                 "--buffered-io", "-t", "1"]) == 0
    assert "\ncompute uses 1 thread (" in "\n" + capsys.readouterr().err


def test_python_m_moestream_from_a_folder_that_shadows_the_package_is_one_line(tmp_path):
    (tmp_path / "moestream").mkdir()  # a clone's folder, beside which the user stands
    shadowed = subprocess.run([sys.executable, "-c", "import moestream; print(getattr(moestream, '__file__', None))"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout.strip()
    if shadowed != "None":
        pytest.skip("this install is not shadowed by a folder in the working directory (a non-editable install)")
    done = subprocess.run([sys.executable, "-m", "moestream", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"moestream: error: the folder {tmp_path / 'moestream'} shadows the installed "
                                   "package: run `python -m moestream` from another folder (or the `moestream` command)")


def test_version():
    done = subprocess.run([sys.executable, "-m", "moestream", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"moestream {moestream.__version__}"


def test_replayed_routing_is_labelled_and_a_mismatched_trace_is_one_error_line(model_dir, tmp_path, capsys):
    import dataclasses

    from moestream.checkpoint.index import build_index
    from moestream.trace.format import save_trace
    from tests.synthetic import synthetic_trace

    topology = build_index(model_dir).topology
    trace, out = tmp_path / "trace.npz", tmp_path / "run.json"
    save_trace(synthetic_trace(topology, num_sequences=1, tokens_per_sequence=8), trace)
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "3",
                 "--buffered-io", "--replay-routing", str(trace), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["replayed"] is True
    assert "replayed routing" in capsys.readouterr().out
    other = tmp_path / "other.npz"
    save_trace(synthetic_trace(dataclasses.replace(topology, top_k=topology.top_k + 1), num_sequences=1,
                               tokens_per_sequence=4), other)
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--buffered-io",
                 "--replay-routing", str(other)]) == 2
    captured = capsys.readouterr()
    assert "cannot replay" in _error_line_of(captured.err)
    assert captured.out == ""  # neither the replay label nor a blank line before the error


def test_sync_and_async_flags_give_the_same_tokens_and_report_stalls(model_dir, tmp_path):
    records = []
    for number, flags in enumerate([["--sync"], ["--chunk-size", "1KiB", "--no-reorder"], []]):
        out = tmp_path / f"run{number}.json"
        assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "5",
                     "--expert-budget", "0.3", "--buffered-io", "--json", str(out), *flags]) == 0
        records.append(json.loads(out.read_text()))
    assert records[0]["token_ids"] == records[1]["token_ids"] == records[2]["token_ids"]
    for record in records:
        assert record["stall_ms"] > 0 and record["transfer_ms"] > 0
    assert records[0]["stall_ms"] == pytest.approx(records[0]["transfer_ms"])  # sync: every transfer stalls


def test_a_ratio_as_chunk_size_is_one_error_line(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--chunk-size", "0.5"]) == 2
    assert "--chunk-size" in _error_line(capsys)


def test_ctrl_c_leaves_no_output_file_and_no_thread(model_dir, tmp_path, monkeypatch, capsys):
    import threading

    def interrupted(self, prompts, max_new_tokens=32, on_tokens=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    threads = threading.active_count()
    out = tmp_path / "out"
    out.mkdir()
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--json", str(out / "run.json")]) == 130
    assert list(out.iterdir()) == [] and threading.active_count() == threads
    assert "interrupted" in _error_line(capsys)


def test_default_without_a_trained_model_is_one_error_line_and_no_output(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--policy", "default",
                 "--buffered-io"]) == 2
    captured = capsys.readouterr()
    assert "--predictor-dir DIR" in _error_line_of(captured.err) and captured.out == ""


def test_max_new_tokens_past_the_context_is_capped_saying_so(model_dir, tmp_path, caplog):
    out = tmp_path / "r.json"
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "100000000",
                 "--buffered-io", "--json", str(out)]) == 0
    assert "max new tokens capped at" in caplog.text
    from moestream.checkpoint.index import load_config

    assert len(json.loads(out.read_text())["token_ids"]) < load_config(model_dir).max_position_embeddings


def test_a_checkpoint_without_a_tokenizer_is_one_line_naming_it(model_dir, tmp_path, capsys):
    path = shutil.copytree(model_dir, tmp_path / "no-tokenizer")
    (path / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(path), "--prompt", PROMPT, "--buffered-io"]) == 2
    line = _error_line_of("\n".join(l for l in capsys.readouterr().err.splitlines() if l.startswith("moestream:")))
    assert f"checkpoint directory {path} has no tokenizer.json" in line


def test_a_host_budget_more_than_the_memory_left_is_one_line_before_the_model_loads(model_dir, monkeypatch, capsys):
    from moestream import memory_plan

    monkeypatch.setattr(memory_plan, "host_available", lambda: memory_plan.Available(600 * 2**20, "MemAvailable"))
    opened = []
    monkeypatch.setattr(Engine, "__init__", lambda *args, **kwargs: opened.append(args))
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--host-budget", "1.0"]) == 2
    line = _error_line(capsys)
    assert line.startswith("moestream: error: --host-budget 1: ") and "left of 600.0 MiB available" in line
    assert opened == []
