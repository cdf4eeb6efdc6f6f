"""`moestream demo`: creates its checkpoint once, compares offloaded with all-resident generation."""

import json

import pytest

from moestream.checkpoint.demo import DEMO_NAME, SMALL_NAME, cache_dir
from moestream.checkpoint.make_model import make_config
from moestream.checkpoint.spec import demo_spec
from moestream.cli import main


def test_the_default_demo_model_is_the_issues_topology():
    spec = demo_spec()
    config = make_config(spec)
    adapter = spec.adapter()
    expert_bytes = 3 * spec.hidden_size * spec.intermediate_size * 2  # gate, up, down in bf16
    topology = adapter.topology(config, expert_bytes)
    assert (topology.num_layers, topology.num_experts, topology.top_k) == (26, 64, 6)
    assert topology.num_shared_experts == 2 and spec.dtype == "bf16"
    assert topology.total_expert_bytes >= 2**30


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("MOESTREAM_CACHE")
    assert cache_dir().parts[-2:] == (".cache", "moestream") and DEMO_NAME != SMALL_NAME


def test_small_demo_runs_twice_on_one_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    out = tmp_path / "demo.json"
    args = ["demo", "--small", "--max-new-tokens", "3", "--buffered-io", "--json", str(out)]
    assert main(args) == 0
    first = capsys.readouterr().out
    record = json.loads(out.read_text())
    offloaded, resident = record["runs"]
    assert record["identical_tokens"] and offloaded["token_ids"] == resident["token_ids"]
    assert offloaded["expert_misses"] > 0 and offloaded["bytes_read"]["disk"] > 0
    assert resident["expert_misses"] == 0 and resident["bytes_read"]["disk"] == 0
    assert "creating the demo checkpoint" in first and "TTFT" in first
    sample = first[first.index("sample:"):]
    assert "random weights, so the text is noise" in sample and "offloaded and resident tokens are identical" in sample
    assert offloaded["expert_budget"] == "25%" and resident["expert_budget"] == "100%"
    for run in record["runs"]:  # 2 decode steps per prompt after the prefill's token, at TPOT each
        assert run["generation_tokens_per_s"] == pytest.approx(1e3 / run["tpot_ms"], rel=0.01)
        assert run["prompt_tokens_per_s"] > 0 and "gen tok/s" in first
    assert "no host tier" in first and "host" not in first.split("no host tier")[0].split("disk")[-1]
    made = (tmp_path / SMALL_NAME / "config.json").stat().st_mtime_ns
    assert main(args) == 0
    assert "creating" not in capsys.readouterr().out
    assert (tmp_path / SMALL_NAME / "config.json").stat().st_mtime_ns == made


@pytest.mark.parametrize("flags, message", [
    (["--policy", "nosuch"], "unknown --policy"), (["--device", "tpu"], "unknown --device"),
    (["--horizon-layers", "-1"], "--horizon-layers"), (["--json", "/no/such/folder/d.json"], "/no/such/folder"),
])
def test_bad_flags_are_refused_before_the_demo_checkpoint_is_written(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    assert main(["demo", "--small", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not any(tmp_path.iterdir())
