"""`bench engine --host-compute RULES` (issue 48): each async run once per rule, reporting the share of its
device-tier misses computed on the host, the bytes copied up and the tracer's host compute lane per token;
the host tier is kept apart on the CPU for those runs, and the planner's link is then the host copy."""

import json

import pytest

from moestream.bench.engine.child import run_spec
from moestream.bench.engine.isolation import RunFailed
from moestream.bench.engine.plan import Job, _link_bw, host_rules, jobs, measure
from moestream.bench.engine.report import _host_cell, host_compute_line, print_report, targets
from moestream.bench.engine.spec import RunSpec, host_share
from moestream.cli import build_parser, main
from moestream.errors import MoestreamError


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype="bf16")


def _spec(checkpoint, rule: str, **fields) -> RunSpec:
    return RunSpec(model=str(checkpoint), budget="0.25", host_budget="100%", prompts=("The cat sat on",),
                   max_new_tokens=5, direct_io=False, host_compute=rule, **fields)


def test_every_miss_computed_on_the_host_is_the_whole_share_with_the_same_tokens(checkpoint):
    off, on_host = run_spec(_spec(checkpoint, "off")), run_spec(_spec(checkpoint, "share:1"))
    assert off["host_computed"] == 0 and off["host_lane_spans_per_token"] == 0
    assert on_host["host_slots"] > 0 and on_host["device_slots"] < on_host["host_slots"]  # the host tier kept apart
    assert on_host["host_computed"] > 0 and on_host["host_compute_share"] == 1.0
    assert on_host["expert_misses"] == 0 and on_host["host_bytes_per_token"] == 0  # nothing crossed the link
    assert on_host["host_lane_spans_per_token"] > 0 and on_host["host_lane_ms_per_token"] > 0
    assert on_host["token_ids"] == off["token_ids"]


def test_a_fixed_share_splits_the_misses_between_host_and_link(checkpoint):
    half = run_spec(_spec(checkpoint, "share:0.5", sync=True))
    assert 0 < half["host_compute_share"] < 1 and half["host_bytes_per_token"] > 0
    assert half["host_compute_share"] == host_share(half["host_computed"], half["expert_misses"])


def test_async_runs_repeat_per_rule_and_on_demand_lru_stays_off():
    listed = jobs("", ("off", "share:0.5", "default"))
    assert [(job.policy, job.mode) for job in listed] == [
        ("lru", "sync"), ("lru", "async"), ("default", "async"), ("lru", "async host share:0.5"),
        ("default", "async host share:0.5"), ("lru", "async host default"), ("default", "async host default")]
    assert jobs("") == [Job("lru", True), Job("lru", False), Job("default", False)]  # no rule given: as before
    assert host_rules(" share:0.5,default,share:0.5") == ("share:0.5", "default")
    for text in ("sometimes", "share:2", ""):
        with pytest.raises(MoestreamError, match="--host-compute"):
            host_rules(text)


def test_a_run_computing_on_the_host_keeps_the_host_tier_and_its_link_on_the_cpu():
    context = {"link_bw": 5e9, "disk_bw": 1e9}
    base = RunSpec(model="m", budget="0.25", device="cpu")
    assert _link_bw(Job("lru", False), base, context) == 1e9  # the CPU's one tier: the disk
    assert _link_bw(Job("lru", False, host_compute="share:0.5"), base, context) == 5e9


def test_the_report_shows_the_share_and_lane_and_targets_follow_the_first_rule():
    run = {"host_compute": "share:0.5", "host_compute_share": 0.4, "host_lane_ms_per_token": 1.25,
           "host_lane_spans_per_token": 3.0}
    assert _host_cell(run) == "40% (1.25 ms)"
    assert _host_cell(run | {"host_compute": "off"}) == "-"
    document = {"host_compute": ["default", "off"], "host_threads": 2, "host_budget_mib": 10.0,
                "resident_tpot_ms": 70.0, "floor_rss_mib": 300.0, "dense_mib": 50.0,
                "runs": [{"policy": "default", "mode": "async host default", "budget": 0.25, "budget_mib": 100.0,
                          "tpot_ms": 80.0, "limit_tpot_ms": 80.0, "peak_rss_mib": 500.0, "memory_cap_mib": None}]}
    assert targets(document)["default TPOT <= 1.25x physical limit"] == "ok (1.00x)"
    assert "rules default, off (2 host thread(s))" in host_compute_line(document)
    assert host_compute_line(document | {"host_compute": ["off"]}) is None


def _in_process(spec: RunSpec, cap=None) -> dict:
    """A run as run_isolated's, in this process (a fresh process each costs seconds): a refusal is a RunFailed."""
    try:
        return json.loads(json.dumps(run_spec(RunSpec.from_json(spec.to_json()))))
    except MoestreamError as error:
        raise RunFailed(str(error)) from None


def test_bench_engine_prints_each_rule_s_run_with_its_host_share(checkpoint, capsys):
    argv = ["bench", "engine", "--model", str(checkpoint), "--host-budget", "1.0", "--budgets", "0.25", "--designs",
            "", "--no-hf", "--no-transformers", "--max-new-tokens", "4", "--prompts", "1", "--buffered-io",
            "--host-compute", "off,share:1"]
    args = build_parser(argv).parse_args(argv)
    record = measure(args, _in_process)
    print_report(record, args)
    assert record["host_compute"] == ["off", "share:1"] and record["host_threads"] == 1
    runs = {(r["policy"], r["mode"]): r for r in record["runs"][1:]}
    shared, off = runs["lru", "async host share:1"], runs["lru", "async"]
    assert shared["host_compute"] == "share:1" and shared["host_compute_share"] == 1.0 and shared["host_computed"] > 0
    assert shared["host_slots"] > 0 and shared["link_gbps"] == pytest.approx(record["h2d_gbps"])
    assert off["host_computed"] == 0 and off["host_slots"] == 0  # off: the CPU's one tier, as before
    assert [s["mode"] for s in record["skipped"] if s["policy"] == "default"] == ["async", "async host share:1"]
    printed = capsys.readouterr()
    assert "lru async host share:1 at 0.25: " in printed.err and "on host 100% of misses" in printed.err
    row = next(line for line in printed.out.splitlines() if "async host share:1" in line)
    assert "100% (" in row and "on host (lane)" in printed.out
    assert "host compute: rules off, share:1" in " ".join(printed.out.split())


def test_a_bad_rule_or_thread_count_is_one_error_line(checkpoint, capsys):
    for flags, problem in ((["--host-compute", "off,sometimes"], "--host-compute 'sometimes': unknown rule"),
                           (["--host-threads", "0"], "--host-threads 0: must be between 1")):
        assert main(["bench", "engine", "--model", str(checkpoint), "--budgets", "0.25", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and problem in err[0]
