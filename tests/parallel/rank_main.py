"""One rank of the expert-parallel tests, started by torchrun (or with torchrun's environment).

    rank_main.py same OUT.json RUNS.json   every run of RUNS.json on every rank; rank 0 writes the tokens
    rank_main.py fault kill|stop MODEL      the last rank dies (SIGKILL) or hangs (SIGSTOP) at its 3rd step

Every rank writes its pid to $PIDS_DIR/<rank> first (the tests check that none is left behind).
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

from moestream.config import EngineConfig
from moestream.contracts import Observer
from moestream.parallel.config import ParallelConfig
from moestream.parallel.launch import follow_ranks, leading_engine
from moestream.parallel.ranks import RankFailure, join_ranks, leave_ranks
from moestream.runtime import Engine
from moestream.runtime.scheduling.scheduler import StaticBatches

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
MAX_TOKENS = [6, 3]  # the second row ends first and stays in the static batch


class HiddenDigest(Observer):
    """A digest of every MoE layer's input bits (each after the previous layer's combine)."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def observe(self, event) -> None:
        self.digest.update(event.hidden.tobytes())


def generated(engine: Engine) -> list[list[int]]:
    """A KV probe (a step no request sees), then a static batch whose rows end apart."""
    engine.kv_bytes_per_token()
    seqs = [engine.new_sequence(ids, n) for ids, n in zip(PROMPTS, MAX_TOKENS)]
    scheduler = engine.scheduler(StaticBatches(len(seqs)))
    for seq in seqs:
        scheduler.add(seq)
    while engine.step(scheduler) is not None:
        pass
    return [list(s.output_ids) for s in seqs]


def run_digested(open_engine) -> dict:
    """The tokens and the digest of every layer's input of a run on the engine that open_engine(observers) opens."""
    digest = HiddenDigest()
    with open_engine([digest]) as engine:
        tokens = generated(engine)
    return {"tokens": tokens, "hidden": digest.digest.hexdigest()}


def same(ranks, out: str, runs: str) -> None:
    results = []
    for run in json.loads(Path(runs).read_text()):
        config = EngineConfig(**run["config"])
        if not ranks.leads:
            follow_ranks(ranks)
            continue
        parallel = ParallelConfig(**run["parallel"])
        results.append(run_digested(lambda observers: leading_engine(run["model"], config, parallel, ranks,
                                                                     observers=observers)))
    if ranks.leads:
        Path(out).write_text(json.dumps(results))


class DieAt(Observer):
    def __init__(self, how: str, iteration: int = 3):
        self.how, self.left = how, iteration

    def begin_iteration(self, ctx) -> None:
        self.left -= 1
        if self.left == 0:
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)


def fault(ranks, how: str, model: str) -> None:
    config = EngineConfig(expert_budget=0.5, transfer_timeout_s=ranks.timeout_s)
    if ranks.rank < ranks.world_size - 1:
        if not ranks.leads:
            follow_ranks(ranks)
            return
        with leading_engine(model, config, ParallelConfig(), ranks) as engine:
            engine.generate([PROMPTS[0]], max_new_tokens=1000)
        return
    follow_ranks(ranks, observers=[DieAt(how)])  # the doomed rank


def main() -> int:
    torch.set_num_threads(1)
    (Path(os.environ["PIDS_DIR"]) / os.environ["RANK"]).write_text(str(os.getpid()))
    ranks = join_ranks("cpu", float(os.environ.get("TIMEOUT_S", "30")))
    try:
        if sys.argv[1] == "same":
            same(ranks, *sys.argv[2:])
        else:
            fault(ranks, *sys.argv[2:])
    except RankFailure as error:
        print(f"moestream: error: {error}", file=sys.stderr, flush=True)
        return 2
    finally:
        leave_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
