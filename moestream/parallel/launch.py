"""Expert parallelism from the command line: the ranks that torchrun started, each with its engine.

`run_ranks(args)` joins the ranks. Rank 0 runs the command as one process would; its `open_engine` places the
experts, sends every rank the checkpoint, the settings and the placement, and leads each step (`steps.py`). The
others open their engine over the experts they own (`follow_ranks`) and follow until rank 0 closes; each rank's
budgets are its own (`plan.py`). Rank 0 alone prints and writes. Knows no command."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed as dist

from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.parallel.config import ParallelConfig
from moestream.parallel.placement import Placement
from moestream.parallel.plan import placement_of, plan_lines, rank_config
from moestream.parallel.ranks import RankContext, RankFailure, join_ranks, leave_ranks
from moestream.parallel.shard import ExpertShard
from moestream.parallel.steps import Leader, broadcast, follow
from moestream.settings import from_args


@dataclass(frozen=True)
class Hello:
    """What rank 0 tells every rank before the engines open."""

    model: str
    config: EngineConfig
    placement: Placement


def run_ranks(args) -> int:
    """The command on rank 0 (args.ranks set), the follower's loop (`follow_ranks`) on the others."""
    ranks = join_ranks(args.device, args.transfer_timeout_s)
    try:
        if ranks.leads:
            args.ranks = ranks
            return int(args.handler(args) or 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which drains, then stops the rest
        return follow_ranks(ranks)
    finally:
        leave_ranks()


def open_engine(model, config: EngineConfig, args, **engine_kwargs):
    """The command's engine (a context manager): one process's, or rank 0's among the ranks."""
    from moestream.runtime import Engine

    ranks = getattr(args, "ranks", None)
    if ranks is None:
        engine_kwargs.pop("on_plan", None)
        return Engine(model, config, **engine_kwargs)
    return leading_engine(model, config, from_args(ParallelConfig, args), ranks, **engine_kwargs)


@contextlib.contextmanager
def leading_engine(model, config: EngineConfig, parallel: ParallelConfig, ranks: RankContext,
                   on_plan: Callable[[list[str]], None] | None = None, **engine_kwargs) -> Iterator:
    """Rank 0's engine; the other ranks follow its steps until the block ends."""
    from moestream.checkpoint.index import build_index
    from moestream.runtime import Engine

    topology = build_index(model).topology
    placement, stats = placement_of(parallel, config.replay_routing, topology, ranks.world_size)
    if parallel.expert_parallel_plan:
        placement.save(parallel.expert_parallel_plan)
    if on_plan is not None:
        on_plan(plan_lines(placement, topology, stats))
    broadcast(ranks, Hello(str(Path(model)), config, placement), "the start of the run", ranks.control)
    shard = ExpertShard(placement, ranks)
    leader = Leader(shard)
    engine = _opened(ranks, lambda: Engine(model, rank_config(config, placement, 0, topology, ranks.device), shard=shard,
                                           steps=leader, **engine_kwargs))
    leader.bind(engine)
    try:
        yield engine
    except RankFailure:
        raise  # the others have failed too, or will when this rank's connections close
    except BaseException:
        with contextlib.suppress(RankFailure):  # the first error is the one to report
            leader.close()
        raise
    else:
        leader.close()
    finally:
        engine.close()


def follow_ranks(ranks: RankContext, observers=()) -> int:
    """A follower: opens its engine from rank 0's hello (observers: beside its policy's), runs rank 0's steps."""
    from moestream.checkpoint.index import build_index
    from moestream.runtime import Engine

    hello = broadcast(ranks, None, "the start of the run", ranks.control)
    shard = ExpertShard(hello.placement, ranks)
    with _opened(ranks, lambda: Engine(hello.model, rank_config(hello.config, hello.placement, ranks.rank,
                                                                build_index(hello.model).topology, ranks.device),
                                       shard=shard, observers=observers)) as engine:
        follow(engine, shard)
    return 0


def expert_parallel_report(engine) -> dict | None:
    """The `expert_parallel` record of a run's JSON (None on one process): every rank's figures."""
    if not isinstance(engine.steps, Leader):
        return None
    stats = engine.steps.rank_stats()
    shard = engine.steps.shard
    return {"world_size": len(stats), "placement": shard.placement.name, "backend": dist.get_backend(shard.ranks.steps),
            "ranks": [dataclasses.asdict(s) | {"hit_rate": s.hits / max(s.hits + s.misses, 1)} for s in stats]}


def _opened(ranks: RankContext, build: Callable):
    """Every rank's engine built, or one error on every rank naming the rank that could not build it."""
    engine, failure = None, None
    try:
        engine = build()
    except MoestreamError as error:
        failure = f"rank {ranks.rank} could not open its engine: {error}"
    failures = [None] * ranks.world_size
    with ranks.collective("the opening of the engines"):
        dist.all_gather_object(failures, failure, group=ranks.control)
    if (first := next((f for f in failures if f is not None), None)) is not None:
        if engine is not None:
            engine.close()
        raise RankFailure(first)
    return engine
