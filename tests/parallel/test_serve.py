"""`moestream serve` on gloo ranks: answers (whole and streamed) are one process's tokens; Ctrl-C on the
launcher stops every rank cleanly; idle, rank 0's heartbeats keep the ranks up past the transfer timeout,
and a rank that hangs (SIGSTOP) or dies while the server is idle stops the others with one clear error;
ranks that start further apart than the transfer timeout (as on a loaded machine) still join; no process is
left behind."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moestream import LLM, SamplingParams
from moestream.checkpoint.demo import demo_checkpoint
from tests.parallel.procs import marked, new_mark
from tests.parallel.test_expert_parallel import ROOT, environment, free_port

TIMEOUT_S = 4  # --transfer-timeout-s: short, so that a lost rank is found quickly
LATE_START_S = TIMEOUT_S  # how long after rank 0 waits to join the last rank starts (then imports for seconds)
PROMPTS = ("The experts of a mixture", "def fibonacci(n):")
MAX_TOKENS = 6


def serve_args(port: int) -> list[str]:
    return ["serve", "--model", str(demo_checkpoint(small=True)), "--port", str(port), "--expert-budget", "0.75",
            "--transfer-timeout-s", str(TIMEOUT_S), "--buffered-io"]


def wait_until_serving(url: str, procs: list[subprocess.Popen], limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        exited = [p for p in procs if p.poll() is not None]
        assert not exited, f"a rank exited before the server started: {exited[0].stderr.read()[-3000:]}"
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not start")


def wait_until_joining(master_port: int, procs: list[subprocess.Popen], limit_s: float = 240) -> None:
    """Until rank 0 waits for the others to join (it listens on the master port: read from /proc, not connected to)."""
    deadline = time.monotonic() + limit_s
    while not listening(master_port):
        exited = [p for p in procs if p.poll() is not None]
        assert not exited, f"a rank exited before joining: {exited[0].stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "rank 0 did not start to join"
        time.sleep(0.2)


def listening(port: int) -> bool:
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for row in table.read_text().splitlines()[1:] if table.exists() else ():
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return True
    return False


def completion(url: str, prompt: str, stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if not stream:
        answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as answer:
        data = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return "".join(chunk["choices"][0]["text"] for chunk in map(json.loads, data[:-1]) if chunk["choices"])


def one_process_texts() -> list[str]:
    with LLM(demo_checkpoint(small=True), expert_budget="0.75", direct_io=False) as llm:
        return [llm.generate(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].text for p in PROMPTS]


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_serve_on_two_ranks_answers_as_one_process_and_stops_on_ctrl_c(tmp_path):
    expected = one_process_texts()
    mark, port = new_mark(), free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "moestream", *serve_args(port)]
    launcher = subprocess.Popen(command, env=environment(tmp_path, **mark), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, [launcher])
        assert completion(url, PROMPTS[0], stream=False) == expected[0]
        assert completion(url, PROMPTS[1], stream=True) == expected[1]
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    finally:
        stop_all([launcher])
    assert err.count("moestream: stopped:") == 1 and "moestream: error" not in err, err[-3000:]
    assert "SIGKILL" not in err  # the ranks ended by themselves, within torchrun's grace period
    assert not marked(mark)


@pytest.mark.parametrize("how, victim", [("stop", 0), ("stop", 2), ("kill", 2)])
def test_an_idle_rank_that_hangs_or_dies_stops_the_others(tmp_path, how, victim):
    """Three ranks with torchrun's environment (no agent that would stop them first), the last started once
    rank 0 waits to join, a transfer timeout later (joining waits for it); idle for three transfer timeouts,
    all still serve (heartbeats); then one hangs or dies, and each other rank exits 2 with one error line."""
    mark, port, master = new_mark(), free_port(), free_port()
    procs = []
    for rank in range(3):
        if rank == 2:
            wait_until_joining(master, procs)
            time.sleep(LATE_START_S)
        env = environment(tmp_path, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(master), **mark)
        procs.append(subprocess.Popen([sys.executable, "-m", "moestream", *serve_args(port)], env=env, cwd=ROOT,
                                      stderr=subprocess.PIPE, text=True))
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", procs)
        time.sleep(3 * TIMEOUT_S)
        assert all(p.poll() is None for p in procs), "a rank stopped while the server was idle"
        procs[victim].send_signal(signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        for rank, proc in enumerate(procs):
            if rank == victim:
                continue
            _, err = proc.communicate(timeout=120)  # a guard: without heartbeats they would wait for days
            lines = [line for line in err.splitlines() if line.startswith("moestream: error:")]
            assert proc.returncode == 2, err[-3000:]
            assert len(lines) == 1 and "lost the other ranks" in lines[0], err[-3000:]
    finally:
        stop_all(procs)
    assert not marked(mark)
