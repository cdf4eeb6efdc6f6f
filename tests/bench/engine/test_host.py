"""`--host-budget` in `bench engine` and `bench quant`: the host tier, filled before the timed steps, serves the
device tier's misses (host bytes per token beside disk bytes), the CPU's merge of the tiers is reported as
what the store made, and a budget that does not fit is one line before any expert is loaded."""

import contextlib
import io
import json

import pytest

from moestream.bench.engine.child import run_spec
from moestream.bench.engine.host import copy_gbps
from moestream.bench.engine.spec import RunSpec
from moestream.checkpoint.index import build_index
from moestream.cli import main
from moestream.memory_plan import Available, check_host_room, model_sizes

GIB, MIB = 2**30, 2**20


@pytest.fixture(scope="module")
def small_host_bench(tmp_path_factory):
    """The issue's CPU command on the small demo model: --host-budget 1.0 --budgets 0.25 (figures and table)."""
    root = tmp_path_factory.mktemp("bench_host")
    out, stdout, stderr = root / "bench.json", io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOESTREAM_CACHE", str(root))
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["bench", "engine", "--small", "--host-budget", "1.0", "--budgets", "0.25", "--designs", "",
                         "--no-hf", "--max-new-tokens", "6", "--prompts", "2", "--buffered-io", "--json", str(out)])
    return code, json.loads(out.read_text()), stdout.getvalue()


@pytest.mark.slow
def test_a_warm_host_tier_serves_the_misses_of_a_run_that_keeps_it_apart(small_host_bench):
    code, record, _ = small_host_bench
    assert code == 0
    runs = {(r["policy"], r["mode"]): r for r in record["runs"]}
    sync, merged = runs["lru", "sync"], runs["lru", "async"]
    experts = runs["lru", "async"]["device_slots"]
    assert sync["host_slots"] == experts and sync["device_slots"] < experts  # a host tier apart (--sync)
    assert sync["hit_rate"] < 1 and sync["bytes_per_token"] == 0 and sync["host_bytes_per_token"] > 0
    assert merged["host_slots"] == 0 and merged["host_bytes_per_token"] == 0  # the CPU's one tier, async
    assert sync["host_budget_mib"] == record["host_budget_mib"] > 0 and record["h2d_gbps"] > 0
    assert sync["link_gbps"] == pytest.approx(record["h2d_gbps"])  # the planner sees the copy, not the disk
    assert merged["link_gbps"] == pytest.approx(record["disk_bw_gbps"])


@pytest.mark.slow
def test_host_bytes_per_token_are_printed_beside_disk_bytes(small_host_bench):
    _, record, stdout = small_host_bench
    assert "host KiB/tok" in stdout and "disk KiB/tok" in stdout
    sync = next(r for r in record["runs"] if r["mode"] == "sync")
    row = next(line for line in stdout.splitlines() if " sync " in line)
    assert f"{sync['host_bytes_per_token'] / 1024:.0f}" in row and f"{sync['device_slots']}+{sync['host_slots']}" in row
    text = " ".join(stdout.split())  # the report wraps its lines
    assert "host budget 100%" in text and "on the CPU only --sync runs keep a host tier apart" in text


@pytest.mark.slow
def test_the_all_resident_run_is_compared_with_plain_transformers(small_host_bench):
    _, record, stdout = small_host_bench
    plain = next(r for r in record["runs"] if r["policy"] == "transformers")
    assert record["runs"][1] is plain and plain["mode"] == "plain" and plain["hit_rate"] is None  # after ours
    versus = record["transformers"]
    assert versus["same_tokens"] is True and versus["ratio"] > 0 and versus["warmup_steps"] == 3
    assert versus["transformers_steady_tpot_ms"] == plain["steady_tpot_ms"]
    text = " ".join(stdout.split())  # the report wraps its lines
    assert "all resident vs plain transformers" in text and f"{versus['ratio']:.2f}x" in text
    assert versus["cpu_ratio"] > 0 and f"in CPU time {versus['cpu_ratio']:.2f}x" in text


def test_a_sync_run_without_the_warm_up_reads_its_misses_from_disk(tiny_checkpoint):
    """The reference of the first test: the same run with no host budget reads from disk, so that the host
    tier's warm-up is what took the disk out."""
    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype="bf16")
    base = RunSpec(model=str(path), budget="0.25", sync=True, prompts=("The cat sat on",), max_new_tokens=5,
                   direct_io=False)
    cold, warm = run_spec(base), run_spec(RunSpec(**{**base.__dict__, "host_budget": "100%"}))
    assert cold["bytes_per_token"] > 0 and cold["host_bytes_per_token"] == 0 and cold["host_slots"] == 0
    assert warm["bytes_per_token"] == 0 and warm["host_bytes_per_token"] > 0
    assert warm["token_ids"] == cold["token_ids"]


def test_a_host_budget_more_than_the_memory_left_is_refused_with_the_figures(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype="bf16")
    experts, sizes = build_index(path).topology.total_expert_bytes, model_sizes(path)
    roomy = Available(64 * GIB, "MemAvailable")
    check_host_room("100%", sizes, "cpu", experts, roomy)  # fits: nothing raised
    with pytest.raises(Exception) as refused:
        check_host_room("100%", sizes, "cpu", experts, Available(700 * MIB, "MemAvailable"))
    message = str(refused.value)
    assert message.startswith("--host-budget 100%: ") and "700.0 MiB available (MemAvailable)" in message
    assert "the dense part" in message and "the largest device budget" in message
    with pytest.raises(Exception, match="--host-budget 100%: pinning .* failed \\(out of pinned memory"):
        check_host_room("100%", sizes, "cuda", 0, roomy, pin=_failing_pin)
    check_host_room("0B", sizes, "cpu", experts, Available(1, "MemAvailable"))  # no host tier: nothing to check


def _failing_pin(num_bytes: int) -> None:
    raise RuntimeError("out of pinned memory\nmore detail")


@pytest.mark.parametrize("flags, problem", [
    (["--host-budget", "1.0"], "--host-budget 100%: "),
    (["--host-budget", "auto"], "--host-budget auto: the bench takes a ratio"),
])
def test_bench_engine_refuses_a_host_budget_in_one_line_before_any_run(tiny_checkpoint, capsys, monkeypatch, flags,
                                                                        problem):
    import moestream.memory_plan

    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype="bf16")
    monkeypatch.setattr(moestream.memory_plan, "host_available", lambda: Available(600 * MIB, "MemAvailable"))
    assert main(["bench", "engine", "--model", str(path), "--budgets", "0.25", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moestream: error: {problem}") and "bench engine:" not in err[0]


def test_bench_quant_refuses_a_host_budget_that_does_not_fit(tiny_checkpoint, capsys, monkeypatch):
    import moestream.memory_plan

    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype="bf16")
    monkeypatch.setattr(moestream.memory_plan, "host_available", lambda: Available(600 * MIB, "MemAvailable"))
    assert main(["bench", "quant", "--models", str(path), "--policy", "lru", "--host-budget", "1.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host-budget" in err[0] and "600.0 MiB available" in err[0]


def test_bench_quant_runs_with_a_warm_host_tier(tiny_checkpoint, tmp_path, capsys):
    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype="bf16")
    out = tmp_path / "quant.json"
    assert main(["bench", "quant", "--models", str(path), "--policy", "lru", "--host-budget", "1.0",
                 "--max-new-tokens", "4", "--buffered-io", "--json", str(out)]) == 0
    merged, sync = json.loads(out.read_text())  # async (the CPU's one tier), then on-demand LRU
    assert sync["host_slots"] > 0 and sync["bytes_per_token"] == 0 and sync["host_bytes_per_token"] > 0
    assert merged["host_slots"] == 0 and merged["host_budget"] == sync["host_budget"] != "0B"
    assert f"(+ {sync['host_bytes_per_token'] / 1e6:.2f} MB from the host tier)" in capsys.readouterr().out


def test_the_copy_link_is_measured():
    assert copy_gbps(1 * MIB, "cpu") > 0.1
