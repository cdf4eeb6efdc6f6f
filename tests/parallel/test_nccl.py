"""Expert parallelism on CUDA (skipped without a CUDA device; run by scripts/gpu-check.sh, step `ep`):
`generate --device cuda` under torchrun gives one process's greedy tokens on one rank (NCCL), on two ranks
sharing one GPU (gloo: NCCL refuses two ranks on one device) and, where there are two GPUs, on two ranks
with one each (NCCL)."""

import json
import subprocess
import sys

import pytest
import torch

from moestream.cli import main
from tests.parallel.procs import marked, new_mark
from tests.parallel.test_expert_parallel import ROOT, environment, free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
RUNS = [(1, "0", "nccl"), (2, "0", "gloo"),
        pytest.param(2, "0,1", "nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU"))]


@pytest.mark.parametrize("world_size, devices, backend", RUNS)
def test_generate_on_cuda_ranks_gives_one_process_tokens(tiny_checkpoint, tmp_path, world_size, devices, backend):
    model = tiny_checkpoint("qwen3_moe")
    common = ["generate", "--model", str(model), "--prompt", "the experts", "--max-new-tokens", "6",
              "--expert-budget", "0.5", "--device", "cuda"]
    assert main(common + ["--json", str(tmp_path / "one.json")]) == 0
    mark = new_mark()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size), "--master-port",
               str(free_port()), "-m", "moestream", *common, "--json", str(tmp_path / "ranks.json")]
    done = subprocess.run(command, env=environment(tmp_path, CUDA_VISIBLE_DEVICES=devices, **mark), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one, ranks = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "ranks.json"))
    assert ranks["token_ids"] == one["token_ids"]
    parallel = ranks["expert_parallel"]
    assert (parallel["world_size"], parallel["backend"]) == (world_size, backend)
    assert all(r["hits"] + r["misses"] > 0 for r in parallel["ranks"])
    assert not marked(mark)
