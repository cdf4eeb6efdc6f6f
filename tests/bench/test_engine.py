"""`moestream bench engine --small` end to end: every run in its own process, the issue's JSON schema,
every figure sane. Figures themselves are the benchmark's business, not the test's."""

import contextlib
import io
import json

import pytest
import torch

from moestream.checkpoint.index import build_index
from moestream.cli import main
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace

RUN_KEYS = {"policy", "budget", "budget_mib", "mode", "tpot_ms", "ttft_ms", "hit_rate", "stall_ms_per_token",
            "overlap", "bytes_per_token", "peak_rss_mib", "limit_tpot_ms",
            "routed_expert_ms", "memory_cap_mib", "cgroup_peak_mib",  # the issue's, + ours
            "host_budget_mib", "host_bytes_per_token", "steady_tpot_ms", "device_slots", "host_slots", "link_gbps",
            "host_compute", "host_computed", "host_compute_share", "host_lane_ms_per_token",  # --host-compute
            "host_lane_spans_per_token"}
TOP_KEYS = {"runs", "resident_tpot_ms", "floor_rss_mib", "dense_mib", "disk_bw_gbps"}


@pytest.fixture(scope="module")
def small_bench(tmp_path_factory):
    """The small demo model, a synthetic trace of its routing shape, and the bench's JSON and output."""
    root = tmp_path_factory.mktemp("bench_engine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOESTREAM_CACHE", str(root))
        from moestream.checkpoint.demo import demo_checkpoint

        topology = build_index(demo_checkpoint(small=True)).topology
        trace = root / "trace.npz"
        save_trace(synthetic_trace(topology, num_sequences=3, tokens_per_sequence=10, seed=1), trace)
        out, err = root / "bench.json", io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["bench", "engine", "--small", "--replay-routing", str(trace), "--budgets", "0.5",
                         "--designs", "", "--max-new-tokens", "3", "--buffered-io", "--memory-cap", "auto",
                         "--json", str(out)])
    return code, json.loads(out.read_text()), err.getvalue()


@pytest.mark.slow
def test_the_document_follows_the_issue_schema(small_bench):
    code, record, _ = small_bench
    assert code == 0
    assert TOP_KEYS <= set(record)
    assert all(set(run) == RUN_KEYS for run in record["runs"])
    caps = (False, True) if record["memory_cap"]["applied"] else (False,)  # each run again under the cap, if one applies
    offloaded = [("lru", "sync"), ("lru", "async"), ("hf-accelerate", "sync")]
    assert [(r["policy"], r["mode"], r["budget"], r["memory_cap_mib"] is not None) for r in record["runs"]] == [
        ("lru", "async", 1.0, False), ("transformers", "plain", 1.0, False),
        *((policy, mode, 0.5, cap) for policy, mode in offloaded for cap in caps)]
    assert [(s["policy"], s["budget"]) for s in record["skipped"]] == [("default", "0.5")]  # untrained: no capped twin
    assert "trained predictor" in record["skipped"][0]["reason"] and record["skipped"][0]["memory_cap_mib"] is None


@pytest.mark.slow
def test_every_figure_is_sane(small_bench):
    _, record, _ = small_bench
    resident, plain, *offloaded = record["runs"]
    assert resident["hit_rate"] == 1.0 and resident["bytes_per_token"] == 0
    assert record["resident_tpot_ms"] == resident["tpot_ms"] > 0
    assert record["floor_rss_mib"] > 50 and record["dense_mib"] > 0 and record["disk_bw_gbps"] > 0
    for run in record["runs"]:
        assert run["tpot_ms"] > 0 and run["ttft_ms"] > 0 and run["bytes_per_token"] >= 0
        assert run["peak_rss_mib"] > record["floor_rss_mib"] * 0.9
        assert run is plain or run["limit_tpot_ms"] >= record["resident_tpot_ms"]
        assert run["host_budget_mib"] == 0 and run["host_bytes_per_token"] in (0, None)  # no --host-budget
        assert run["overlap"] is None or 0.0 <= run["overlap"] <= 1.0
        cap, peak = run["memory_cap_mib"], run["cgroup_peak_mib"]
        assert peak is None if cap is None else (peak is None or 0 < peak <= cap)  # capped: None if no peak kept
    assert record["integrity"]["digest_check_vs_disk_read"] > 0 and record["integrity"]["finite_check_us_per_token"] > 0
    offloaded = [run for run in offloaded if run["memory_cap_mib"] is None]
    for run in offloaded[:2]:  # our engine at half the experts: misses cost reads and stalls
        assert 0.0 < run["hit_rate"] < 1.0 and run["bytes_per_token"] > 0 and run["stall_ms_per_token"] > 0
        assert run["budget_mib"] == pytest.approx(resident["budget_mib"] / 2, rel=0.01)
    assert offloaded[0]["hit_rate"] == offloaded[1]["hit_rate"]  # same replayed rows, same LRU
    assert all(run["routed_expert_ms"] > 0 for run in [resident, *offloaded[:2]])
    assert offloaded[2]["routed_expert_ms"] is None  # transformers + accelerate: no expert of ours
    assert record["cost_model"]["layer_compute_ms"] > 0 and record["cost_model"]["disk_to_host_gbps"] > 0
    assert plain["limit_tpot_ms"] is None and plain["routed_expert_ms"] is None
    assert record["transformers"]["same_tokens"] is None  # our engine followed the replayed routing
    assert record["memory_cap"]["requested"] == "auto" and record["memory_cap"]["reason"]


@pytest.mark.slow
def test_each_run_prints_its_figures_as_it_ends(small_bench):
    _, record, err = small_bench
    assert record["oracle_bytes_per_token"]["0.5"] > 0  # the bound beside the runs' bytes
    lines = [line for line in err.splitlines() if line.startswith("bench engine: ")]
    assert len(lines) == len(record["runs"]) + len(record["skipped"])  # every run, in the order they ran
    assert lines[0].startswith("bench engine: all resident at 1.0: ")
    assert f"TPOT {record['runs'][0]['tpot_ms']:.1f} ms" in lines[0]


@pytest.mark.slow
def test_the_document_says_which_checkpoint_and_device_it_ran(small_bench):
    _, record, _ = small_bench
    assert record["device"] == "cpu" and record["prompts"] == 4 and record["model"].endswith("demo-small")
    assert record["checkpoint"].startswith("2 MoE layers x 16 experts (top-6)")


@pytest.mark.parametrize("flags, problem", [
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--prompts", "5"], "--prompts must be between 1 and 4"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_a_bad_device_or_prompt_count_is_one_error_line(capsys, flags, problem):
    assert main(["bench", "engine", "--small", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0] and "Traceback" not in err[0]
