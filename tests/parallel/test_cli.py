"""The commands under torchrun: generate on two ranks prints and writes as one process does (rank 0
alone), with every rank's figures in --json; `moestream plan --expert-parallel N` shows each rank."""

import json
import subprocess
import sys

from moestream.checkpoint.index import build_index
from moestream.cli import main
from moestream.parallel.placement import Placement
from moestream.trace.format import save_trace
from tests.parallel.test_expert_parallel import ROOT, environment, free_port
from tests.synthetic import synthetic_trace


def test_generate_on_two_ranks_writes_what_one_process_writes(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("qwen3_moe")
    trace = save_trace(synthetic_trace(build_index(model).topology, num_sequences=4, tokens_per_sequence=16),
                       tmp_path / "routing.trace")
    common = ["generate", "--model", str(model), "--prompt", "the experts", "--max-new-tokens", "5",
              "--expert-budget", "0.5"]
    assert main(common + ["--json", str(tmp_path / "one.json")]) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "moestream", *common, "--json", str(tmp_path / "two.json"),
               "--expert-parallel-placement", "balanced", "--expert-parallel-trace", str(trace),
               "--expert-parallel-plan", str(tmp_path / "plan.json")]
    done = subprocess.run(command, env=environment(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two["token_ids"] == one["token_ids"] and two["text"] == one["text"]
    parallel = two["expert_parallel"]
    assert (parallel["world_size"], parallel["placement"]) == (2, "balanced")
    assert [r["rank"] for r in parallel["ranks"]] == [0, 1]
    assert all(r["hits"] + r["misses"] > 0 and r["owned_experts"] > 0 for r in parallel["ranks"])
    assert Placement.load(tmp_path / "plan.json").world_size == 2
    assert done.stderr.count("expert parallelism: 2 ranks, placement balanced") == 1  # rank 0 alone
    assert done.stderr.count(" tokens, TTFT ") == 1


def test_plan_shows_what_each_rank_owns(tiny_checkpoint, capsys):
    assert main(["plan", "--model", str(tiny_checkpoint("mixtral")), "--expert-parallel", "4"]) == 0
    out = capsys.readouterr().out
    assert "expert parallelism: 4 ranks, placement round-robin" in out
    assert all(f"rank {rank}: 8 experts (2.0 a layer), 384.0 KiB" in out for rank in range(4))


def test_a_balanced_placement_without_a_trace_is_one_line(tiny_checkpoint, capsys):
    args = ["plan", "--model", str(tiny_checkpoint("mixtral")), "--expert-parallel", "2",
            "--expert-parallel-placement", "balanced"]
    assert main(args) == 2
    assert "needs a routing trace" in capsys.readouterr().err
