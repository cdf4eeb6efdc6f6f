"""`bench engine` under torchrun: every run of the bench on every rank, each still a fresh process.

Rank 0 measures as one process does and before each run tells every rank its spec, memory cap and a
fresh port; each rank starts its own child (isolation.py), and the children form a process group on that
port. Rank 0's child runs the engine run over its leading engine (runners.py), the others follow it;
its figures carry every rank's. A run failing on one rank fails on all; the bench goes on with the next.
Knows no figure of a run.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch.distributed as dist

from moestream.bench.engine.isolation import RunFailed, run_isolated
from moestream.bench.engine.spec import RunSpec
from moestream.parallel.ranks import RankContext, free_port


def ranked_runner(ranks: RankContext) -> Callable[..., dict]:
    """Rank 0's `run_isolated`: the run on every rank, rank 0's figures."""

    def run(spec: RunSpec, limit_bytes: int | None = None) -> dict:
        port = free_port()
        _announce(ranks, (spec.to_json(), limit_bytes, port))
        return run_isolated(spec, limit_bytes, rank_env(ranks, port))

    return run


def stop_runs(ranks: RankContext) -> None:
    """Tells the other ranks that the bench is over."""
    _announce(ranks, None)


def follow_runs(ranks: RankContext) -> int:
    """Another rank of the bench: each run rank 0 announces, in a child of this rank, until it stops."""
    while (job := _announce(ranks, None)) is not None:
        spec, limit_bytes, port = job
        with contextlib.suppress(RunFailed, OSError):  # rank 0 reports the run's failure
            run_isolated(RunSpec.from_json(spec), limit_bytes, rank_env(ranks, port))
    return 0


def rank_env(ranks: RankContext, port: int) -> dict[str, str | None]:
    """The child's torch.distributed environment: this rank of a group whose store rank 0's child serves
    on port (not torchrun's agent store: None removes the variable)."""
    return {"RANK": str(ranks.rank), "WORLD_SIZE": str(ranks.world_size), "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": None}


def run_in_child(spec: RunSpec, run_spec: Callable[..., dict]) -> dict:
    """In a run's child process under rank_env: rank 0's figures (run_spec(spec, ranks)), or {"rank": r}
    once a follower's engine has followed rank 0's to its end."""
    from moestream.bench.engine.runners import prepare
    from moestream.config import EngineConfig
    from moestream.parallel.launch import follow_ranks
    from moestream.parallel.ranks import join_ranks, leave_ranks

    ranks = join_ranks(spec.device, EngineConfig.transfer_timeout_s)
    try:
        if ranks.leads:
            return run_spec(spec, ranks)
        follow_ranks(ranks, prepare=lambda engine: prepare(engine, spec, ranks))  # as rank 0's run does
        return {"rank": ranks.rank}
    finally:
        leave_ranks()


def _announce(ranks: RankContext, job: tuple | None) -> tuple | None:
    box = [job]
    with ranks.collective("the announcement of a bench run"):
        dist.broadcast_object_list(box, src=0, group=ranks.control)
    return box[0]
