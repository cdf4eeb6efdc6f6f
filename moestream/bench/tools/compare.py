"""Side-by-side comparison of registered policies on one trace: fit once, replay many settings.

Each policy is fitted once on the training trace (each trained predictor kind once), then
deep-copied for every (protocol, cost model, cache ratio) replay of the test trace, so no run sees
another's online state. Runs are spread over worker processes. Also measures prediction quality
per horizon and the policy's own time per layer decision (observe + predict + plan, timed by its
driver), which is the overhead the engine pays per decision. Knows policies only through the
registry and the policy contract.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.cost import PRESETS, get_cost_model
from moestream.bench.sim.protocols import simulate
from moestream.bench.sim.replay import head_tokens
from moestream.bench.tools.overhead import overhead_us_per_layer
from moestream.bench.tools.prediction import evaluate_predictor
from moestream.config import EngineConfig
from moestream.contracts import NullPredictor, Policy
from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.policies.trained import TrainedPolicy, load_matching
from moestream.progress import progress_bar
from moestream.settings import same_as
from moestream.threads import torch_threads
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

COST_FREE_PROTOCOLS = ("moe-beyond",)  # protocols whose result does not depend on the cost model
KEPT_METRICS = ("hit_rate", "stall_ms_per_token", "tpot_ratio_vs_resident", "bytes_per_token",
                "wasted_prefetch_ratio", "late_prefetch_ratio", "per_layer_hit_rate")


class CompareError(MoestreamError):
    """Settings that cannot be compared."""


@dataclass(frozen=True)
class CompareConfig:
    """What `bench policies` compares (its flags refer to these defaults)."""

    policies: tuple[str, ...]
    cache_ratios: tuple[float, ...] = (0.05, 0.10, 0.25, 0.50)
    cost_models: tuple[str, ...] = tuple(PRESETS)
    protocols: tuple[str, ...] = ("stream", "moe-beyond")
    horizons: tuple[int, ...] = tuple(range(1, 9))
    horizon_layers: int = same_as(EngineConfig, "horizon_layers")  # look-ahead the replays ask of predictors
    num_prediction_tokens: int = 4000  # test tokens scored for precision/recall/F1 per horizon
    num_overhead_tokens: int = 200  # test tokens timed for per-layer overhead
    num_workers: int = 2
    predictor_dirs: tuple[str, ...] = ()  # trained predictors, used instead of fitting policies of their kind

    def __post_init__(self):
        if not self.policies:
            raise CompareError("no policy to compare")
        for name in self.policies:
            POLICIES.get(name)
        for name in self.cost_models:
            get_cost_model(name)
        if any(not 0.0 < r <= 1.0 for r in self.cache_ratios):
            raise CompareError(f"cache ratios must lie in (0, 1], got {self.cache_ratios}")
        if self.num_workers < 1 or min(self.horizons, default=1) < 0:
            raise CompareError("num_workers must be >= 1 and horizons >= 0")


@dataclass
class Comparison:
    replays: dict = field(default_factory=dict)  # protocol -> cost model -> policy -> ratio -> metrics
    prediction: dict = field(default_factory=dict)  # policy -> horizon -> {precision, recall, f1}
    overhead_us_per_layer: dict = field(default_factory=dict)  # policy -> median microseconds per layer decision
    fit_seconds: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # policy -> reason


@dataclass(frozen=True)
class Job:
    policy: str
    protocol: str
    cost_model: str
    cache_ratio: float


def compare(train: Trace, test: Trace, config: CompareConfig) -> Comparison:
    result = Comparison()
    fitted = fit_policies(train, test, config, result)
    jobs = replay_jobs(fitted, config)
    # forked workers inherit torch's thread pool, and a child deadlocks in its first parallel op if the parent ran
    # one with several threads (e.g. loading a predictor): the parent forks and works single-threaded meanwhile
    with torch_threads(1), ProcessPoolExecutor(config.num_workers, mp_context=get_context("fork")) as pool:
        futures = {job: pool.submit(run_job, fitted[job.policy], test, job, config.horizon_layers) for job in jobs}
        for name, policy in fitted.items():
            result.prediction[name] = prediction_quality(policy, test, config)
        for job, future in progress_bar(futures.items(), total=len(futures), desc="replays", unit="replay"):
            by_policy = result.replays.setdefault(job.protocol, {}).setdefault(job.cost_model, {})
            by_policy.setdefault(job.policy, {})[job.cache_ratio] = future.result()
    for name, policy in fitted.items():  # timed once the workers are done, on a quieter machine
        result.overhead_us_per_layer[name] = overhead_us_per_layer(
            policy, head_tokens(test, config.num_overhead_tokens), config.horizon_layers)
    return result


def fit_policies(train: Trace, test: Trace, config: CompareConfig, result: Comparison) -> dict[str, Policy]:
    """Fits every policy, or loads a directory of its predictor's kind. A kind is trained once: the
    first of its policies saves what it learned, and the others (ablations and bounds built on the
    same design, which differ only in how they act) load it."""
    fitted = {}
    with tempfile.TemporaryDirectory(prefix="moestream-fit-") as scratch:
        directories = list(config.predictor_dirs)
        for name in config.policies:
            policy_class = POLICIES.get(name)
            missing = [f for f in policy_class.trace_needs if getattr(train, f) is None or getattr(test, f) is None]
            if missing:
                result.skipped[name] = f"needs trace field(s) {', '.join(missing)}, absent from this trace"
                continue
            start = time.perf_counter()
            fitted[name] = _fitted(policy_class(test.topology), train, directories, Path(scratch) / name)
            result.fit_seconds[name] = round(time.perf_counter() - start, 2)
            log.info("fitted %s in %.1f s", name, result.fit_seconds[name])
    return fitted


def _fitted(policy: Policy, train: Trace, directories: list, scratch: Path) -> Policy:
    if load_matching(policy, directories) is None:
        policy.fit(train)
        if isinstance(policy, TrainedPolicy):
            directories.append(policy.save(scratch))
    return policy


def replay_jobs(fitted: dict[str, Policy], config: CompareConfig) -> list[Job]:
    jobs = []
    for protocol in config.protocols:
        costs = config.cost_models[:1] if protocol in COST_FREE_PROTOCOLS else config.cost_models
        for cost in costs:
            jobs += [Job(name, protocol, cost, ratio) for name in fitted for ratio in config.cache_ratios]
    return jobs


def run_job(policy: Policy, test: Trace, job: Job, horizon_layers: int) -> dict:
    config = SimConfig(cache_ratio=job.cache_ratio, cost=get_cost_model(job.cost_model), horizon_layers=horizon_layers)
    start = time.perf_counter()
    metrics = simulate(copy.deepcopy(policy), test, config, job.protocol)
    kept = {key: metrics[key] for key in KEPT_METRICS if key in metrics}
    return kept | {"replay_seconds": round(time.perf_counter() - start, 2)}


def prediction_quality(policy: Policy, test: Trace, config: CompareConfig) -> dict:
    if not config.horizons or isinstance(policy.predictor, NullPredictor):
        return {}
    sample = head_tokens(test, config.num_prediction_tokens)
    quality = {}
    for horizon in config.horizons:
        fresh = copy.deepcopy(policy)
        fresh.prepare(sample)
        counts = evaluate_predictor(fresh.predictor, sample, horizon)
        quality[horizon] = {"precision": counts.precision(), "recall": counts.recall(), "f1": counts.f1()}
    return quality
