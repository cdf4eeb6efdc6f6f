"""bench engine --expert-parallel: each rank's figures summed over the prompts of generate's --json; each
process under a memory cgroup of its share (where one can be made), each rank in its own."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from moestream.bench.engine import isolation, parallel
from moestream.bench.engine.parallel import summary, summed_report
from moestream.cli import main


def record(tokens: int, tpot_ms: float, ranks: list[tuple[int, int, int, float]] | None = None) -> dict:
    out = {"token_ids": list(range(tokens)), "tpot_ms": tpot_ms, "expert_hits": 3, "expert_misses": 1,
           "bytes_read": {"disk": 400, "host": 0}}
    if ranks is not None:
        out["expert_parallel"] = {"world_size": len(ranks), "placement": "round-robin", "ranks": [
            {"rank": r, "hits": h, "misses": m, "bytes_read": {"disk": d, "host": 0}, "combine_s": c, "owned_experts": 4}
            for r, (h, m, d, c) in enumerate(ranks)]}
    return out


def test_one_process_is_one_rank():
    got = summary([record(4, 10.0), record(4, 20.0)])
    assert got["tpot_ms"] == 15.0
    assert got["per_rank"] == [{"hit_rate": 0.75, "disk_bytes_per_token": 100.0, "combine_ms_per_token": 0.0}]


def test_each_rank_is_summed_over_the_prompts():
    got = summary([record(2, 10.0, [(1, 1, 100, 0.001), (2, 0, 0, 0.002)]),
                   record(2, 10.0, [(1, 1, 300, 0.003), (0, 2, 400, 0.002)])])
    assert [r["hit_rate"] for r in got["per_rank"]] == [0.5, 0.5]
    assert [r["disk_bytes_per_token"] for r in got["per_rank"]] == [100.0, 100.0]
    assert [r["combine_ms_per_token"] for r in got["per_rank"]] == pytest.approx([1.0, 1.0])


CAPS = {"applied": True, "reason": "cgroup v1", "requested": "auto", "experts_mib": 1000.0, "floor_mib": 400.0,
        "dense_mib": 50.0}


def test_a_rank_is_capped_as_one_process_holding_its_share_of_the_experts():
    one = parallel.run_cap_mib(CAPS, 0.5, 0.5)
    assert one == 400.0 + 50.0 + 500.0 + parallel.GENERATE_SLACK_MIB
    assert parallel.run_cap_mib(CAPS, 0.5, 0.25) == one - 250.0  # one of 2 ranks, or one process at 0.25
    assert parallel.run_cap_mib(CAPS | {"requested": "2000", "floor_mib": None}, 0.4, 0.1) == 2000.0 - 300.0
    assert parallel.run_cap_mib({"applied": False, "reason": "no cgroup"}, 0.5, 0.25) is None


def test_where_no_cgroup_can_be_made_the_runs_go_uncapped_and_say_why(monkeypatch, tmp_path):
    monkeypatch.setattr(isolation, "cap_support", lambda: "no memory cgroup (v2 or v1) under /x")
    caps = parallel.memory_caps(argparse.Namespace(memory_cap=None), tmp_path)
    assert caps == {"applied": False, "reason": "no memory cgroup (v2 or v1) under /x"}
    assert parallel.cap_line(caps) == ("memory caps NOT applied (no memory cgroup (v2 or v1) under /x): "
                                       "every run uncapped")


def test_each_rank_enters_its_own_cgroup(tmp_path):
    if isolation.cap_support() is not None:
        pytest.skip(f"no memory cgroup can be made here: {isolation.cap_support()}")
    show = [sys.executable, "-c", "import sys; sys.stdout.write(open('/proc/self/cgroup').read())"]
    with isolation.rank_cgroups([256 << 20, 128 << 20]) as (prefix, paths):
        for rank, path in enumerate(paths):
            done = subprocess.run([sys.executable, "-m", "moestream.bench.engine.rank_cgroup", prefix, *show],
                                  env=os.environ | {"LOCAL_RANK": str(rank)}, capture_output=True, text=True,
                                  check=True)
            memory = next(line for line in done.stdout.splitlines() if ":memory:" in line or line.startswith("0::"))
            assert memory.endswith(path.name)
            assert isolation.cgroup_peak_mib(path) > 0
    assert not any(path.exists() for path in paths)


def test_bench_engine_expert_parallel_caps_every_process(tmp_path):
    """2 ranks against one process at the same and at half the memory, each process under its cgroup cap
    (where the machine allows one: else uncapped, said in one line)."""
    out = tmp_path / "ep.json"
    done = subprocess.run([sys.executable, "-m", "moestream", "bench", "engine", "--small", "--expert-parallel", "2",
                           "--budgets", "0.5", "--prompts", "1", "--max-new-tokens", "2", "--buffered-io", "--json",
                           str(out)], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = {row["run"]: row for row in document["rows"]}
    assert list(rows) == ["1 process at 0.5", "1 process at 0.25", "2 ranks at 0.5 in all"]
    assert [len(row["per_rank"]) for row in rows.values()] == [1, 1, 2]
    assert all(r["combine_ms_per_token"] > 0 for r in rows["2 ranks at 0.5 in all"]["per_rank"])
    if not document["memory_cap"]["applied"]:
        assert done.stderr.count("runs uncapped") == 1
        return
    full, half, ranks = (rows[name] for name in rows)
    assert ranks["memory_cap_mib"] == half["memory_cap_mib"] < full["memory_cap_mib"]
    assert len(ranks["cgroup_peak_mib"]) == 2
    assert all(0 < peak <= row["memory_cap_mib"] for row in rows.values() for peak in row["cgroup_peak_mib"])
    assert "cap MiB" in done.stdout


def test_each_rank_is_summed_over_the_generations_of_a_run():
    def report(rank_figures):
        return {"world_size": 2, "placement": "balanced", "backend": "gloo", "ranks": [
            {"rank": r, "hits": h, "misses": m, "bytes_read": {"disk": d, "host": 0}, "combine_s": 0.5,
             "owned_experts": 4, "hit_rate": h / (h + m)} for r, (h, m, d) in enumerate(rank_figures)]}

    got = summed_report([report([(1, 3, 100), (2, 2, 50)]), report([(3, 1, 10), (0, 4, 60)])])
    assert (got["world_size"], got["placement"]) == (2, "balanced")
    assert [(r["rank"], r["hits"], r["misses"], r["hit_rate"], r["bytes_read"]["disk"], r["combine_s"])
            for r in got["ranks"]] == [(0, 4, 4, 0.5, 110, 1.0), (1, 2, 6, 0.25, 110, 1.0)]


def test_bench_engine_under_torchrun_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["bench", "engine", "--small"]) == 2
    assert "run it without torchrun" in capsys.readouterr().err
