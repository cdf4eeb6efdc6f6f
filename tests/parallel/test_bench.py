"""`moestream bench engine` under torchrun: every run on both gloo ranks, rank 0 alone prints the table
and writes --json, each run's record carrying every rank's figures; a run that fails on rank 0 stops its
followers (the bench goes on); no process is left behind."""

import json
import subprocess
import sys

from tests.parallel.procs import marked, new_mark
from tests.parallel.test_expert_parallel import ROOT, environment, free_port


def test_bench_engine_on_two_ranks(tmp_path):
    mark = new_mark()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "moestream", "bench", "engine", "--small", "--budgets", "0.5", "--designs", "",
               "--max-new-tokens", "3", "--prompts", "1", "--buffered-io", "--json", str(tmp_path / "bench.json")]
    done = subprocess.run(command, env=environment(tmp_path, **mark), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["expert_parallel"] == {"world_size": 2, "placement": "round-robin"}
    runs = {(run["policy"], run["mode"], run["budget"]): run for run in document["runs"]}
    assert set(runs) == {("lru", "async", 1.0), ("lru", "sync", 0.5), ("lru", "async", 0.5)}
    for run in runs.values():
        ranks = run["expert_parallel"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["owned_experts"] == 16 for r in ranks)
        assert all(r["hits"] + r["misses"] > 0 for r in ranks)
        assert all(r["hit_rate"] == r["hits"] / (r["hits"] + r["misses"]) for r in ranks)
    assert all(r["hit_rate"] == 1.0 for r in runs["lru", "async", 1.0]["expert_parallel"]["ranks"])
    assert all(r["bytes_read"]["disk"] > 0 for r in runs["lru", "sync", 0.5]["expert_parallel"]["ranks"])
    reasons = {s["policy"]: s["reason"] for s in document["skipped"]}
    assert "not run under torchrun" in reasons["hf-accelerate"] and "needs a trained predictor" in reasons["default"]
    assert done.stdout.count("moestream bench engine:") == 1  # the table: rank 0 alone
    assert done.stdout.count("expert parallelism: 2 ranks, placement round-robin") == 1
    assert not marked(mark)
