"""Expert parallelism across gloo ranks on this machine: greedy tokens identical to one process for 1, 2
and 4 ranks (three families, sync, async and replayed routing, both placements); a rank that dies or hangs stops every
other rank with one clear error; no process is left behind."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.checkpoint.index import build_index
from moestream.config import EngineConfig
from moestream.runtime import Engine
from moestream.trace.format import save_trace
from tests.parallel.rank_main import run_digested
from tests.synthetic import synthetic_trace

SCRIPT = Path(__file__).with_name("rank_main.py")
ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("deepseek_v2", "mixtral", "qwen3_moe")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def environment(pids: Path, **extra) -> dict:
    return os.environ | {"PIDS_DIR": str(pids), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | extra


def torchrun(world_size: int, args: list[str], pids: Path, timeout_s: float = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
               "--master-port", str(free_port()), str(SCRIPT), *args]
    return subprocess.run(command, env=environment(pids), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """Every (family, sync or async or replayed routing, placement) run with its single-process tokens."""
    root = tmp_path_factory.mktemp("expert_parallel")
    out = []
    for family in FAMILIES:
        model = tiny_checkpoint(family)
        trace = save_trace(synthetic_trace(build_index(model).topology, num_sequences=4, tokens_per_sequence=16),
                           root / f"{family}.trace")
        for sync, replay in ((False, None), (True, None), (False, str(trace))):
            config = {"expert_budget": 0.5, "sync": sync, "publish_hidden": True, "replay_routing": replay}
            alone = run_digested(lambda observers: Engine(model, EngineConfig(**config), observers=observers))
            for placement in ("round-robin", "balanced"):
                parallel = {"expert_parallel_placement": placement, "expert_parallel_trace": str(trace)}
                out.append({"model": str(model), "config": config, "parallel": parallel} | alone)
    path = root / "runs.json"
    path.write_text(json.dumps(out))
    return path, out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_greedy_tokens_match_one_process(runs, world_size, tmp_path):
    path, expected = runs
    out = tmp_path / "out.json"
    done = torchrun(world_size, ["same", str(out), str(path)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    for run, result in zip(expected, got):
        assert result["tokens"] == run["tokens"], (run["model"], run["config"], run["parallel"])
        assert result["hidden"] == run["hidden"], (run["model"], run["config"], run["parallel"])  # bit for bit
    assert len(got) == len(expected) == 18
    assert not [pid for pid in map(int, (p.read_text() for p in tmp_path.iterdir() if p.name.isdigit())) if alive(pid)]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_that_dies_or_hangs_stops_the_others_with_one_clear_error(tiny_checkpoint, how, tmp_path):
    """Three ranks started with torchrun's environment (no agent that would kill them first); the last
    dies (SIGKILL) or hangs (SIGSTOP) at its third step; each other rank exits 2 with one error line
    within the transfer timeout."""
    model, port, timeout_s = tiny_checkpoint("mixtral"), free_port(), 8
    procs = []
    for rank in range(3):
        env = environment(tmp_path, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TIMEOUT_S=str(timeout_s))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "fault", how, str(model)], env=env, cwd=ROOT,
                                      stderr=subprocess.PIPE, text=True))
    try:
        for proc in procs[:2]:
            _, err = proc.communicate(timeout=600)  # a guard: the start-up on a loaded machine
            lines = [line for line in err.splitlines() if line.startswith("moestream: error:")]
            assert proc.returncode == 2, err[-3000:]
            assert len(lines) == 1 and "lost the other ranks" in lines[0], err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert not [p.pid for p in procs if alive(p.pid)]
