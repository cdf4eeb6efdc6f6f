"""What one `bench engine` run of our engine executes (`RUNS`, by kind: "engine" here, the baselines in
baselines.py): the figures of `spec.summarize` plus what the caller needs (the routing replay's rows, for
the simulator; the tokens; the tiers' slots). It starts cold: the checkpoint's pages are dropped from the
page cache after loading, and after the warm-up (the all-resident run's preload, or the host tier's fill),
before generating.
"""

from __future__ import annotations

import dataclasses
import time

from moestream.bench.engine.spec import Counters, RunSpec, shards, step_times_ms, summarize
from moestream.budget import Budget
from moestream.contracts import Observer
from moestream.errors import MoestreamError
from moestream.registry import Registry

RUNS: Registry = Registry("bench engine run kind")
HOST_LANE = "host compute"  # the tracer's lane of a layer step's experts computed on the host (runtime/offload.py)


class CpuClock(Observer):
    """Process CPU time at the start of every step and at the end of the last one."""

    def __init__(self):
        self.marks: list[float] = []

    def begin_iteration(self, ctx=None) -> None:
        self.marks.append(time.process_time())

    def end_sequence(self, seq_id: int = 0) -> None:
        self.marks.append(time.process_time())

    def tpot_ms(self) -> float:
        """CPU time per decode step: from the start of step 1 to the end of the last step."""
        steps = len(self.marks) - 2
        return (self.marks[-1] - self.marks[1]) * 1e3 / steps if steps > 0 else 0.0


class DecodeMeter(Observer):
    """Snapshots the store's counters and the engine tracer's totals when a generation's first decode
    step begins, and notes the time (wall and CPU) each step begins and the generation ends; keeps each
    iteration's token ids, strings and, if asked (keep_embeddings), embeddings where the engine gave them
    (what the policy saw, for the simulator)."""

    def __init__(self, store, tracer, keep_embeddings: bool = False, host_count=lambda: 0):
        """host_count() -> the experts computed on the host that the engine has not yet handed to a
        generation's metrics (GenerationMetrics.host_computed takes them at its end)."""
        self.store, self.tracer, self.keep_embeddings = store, tracer, keep_embeddings
        self.host_count = host_count
        self.host_at_decode = 0  # host_count() at the start of the first decode step
        self.steps = 0
        self.decode_tokens = 0
        self.at_decode = None  # StoreStats at the start of the first decode step
        self.totals_at_decode = None  # the tracer's totals then
        self.token_ids: list[list[int]] = []  # per iteration of every generation
        self.tokens: list[list[str]] = []  # their strings (empty where the engine has no tokenizer)
        self.embeddings: list[list[list[float]]] = []  # [T, H] each (empty where no observer asked for them)
        self.marks: list[float] = []  # this generation's: when each step began, and when it ended
        self.cpu = CpuClock()  # the same, in process CPU time

    def start(self) -> None:
        self.steps, self.decode_tokens, self.at_decode, self.marks, self.cpu = 0, 0, None, [], CpuClock()

    def begin_iteration(self, ctx) -> None:
        self.marks.append(time.perf_counter())
        self.cpu.begin_iteration()
        self.steps += 1
        self.token_ids.append(ctx.token_ids.tolist())
        self.tokens.append(list(ctx.tokens or ()))
        if self.keep_embeddings:
            self.embeddings.append([] if ctx.embeddings is None else ctx.embeddings.tolist())
        if self.steps == 2:
            self.at_decode, self.totals_at_decode = self.store.stats(), self.tracer.totals()
            self.host_at_decode = self.host_count()
        if self.steps >= 2:
            self.decode_tokens += ctx.num_tokens

    def end_sequence(self, seq_id: int) -> None:
        self.marks.append(time.perf_counter())
        self.cpu.end_sequence()

    def add_decode(self, counters: Counters, end, host_computed: int = 0) -> None:
        """Adds the decode steps' counters (the store's at the end minus at the first decode step);
        host_computed: the generation's experts computed on the host (its metrics'), prefill included."""
        if self.at_decode is None:
            return
        from moestream.runtime.offload import expert_compute
        from moestream.tracer import since

        start = self.at_decode
        counters.hits += end.hits - start.hits
        counters.misses += end.misses - start.misses
        counters.disk_bytes += end.bytes_read["disk"] - start.bytes_read["disk"]
        counters.host_bytes += end.bytes_read["host"] - start.bytes_read["host"]
        counters.disk_reads += end.host_misses - start.host_misses  # device fills from disk
        counters.read_ms += (end.disk_read_s - start.disk_read_s) * 1e3
        counters.copy_ms += (end.copy_s - start.copy_s) * 1e3
        counters.read_batches += end.disk_batches - start.disk_batches
        counters.read_fit = counters.read_fit.plus(end.read_fit.since(start.read_fit))
        experts, seconds = expert_compute(self.tracer.totals(), self.totals_at_decode)
        counters.experts_computed += experts
        counters.expert_compute_ms += seconds * 1e3
        counters.host_computed += max(0, host_computed - self.host_at_decode)
        lane = since(self.tracer.totals(), self.totals_at_decode, HOST_LANE)
        counters.host_lane_ms += lane.seconds * 1e3
        counters.host_lane_spans += lane.spans
        counters.decode_tokens += self.decode_tokens
        counters.step_ms.append(step_times_ms(self.marks[1:]))  # each step begins as the one before ends
        counters.cpu_step_ms.append(step_times_ms(self.cpu.marks[1:]))


def make_policy(spec: RunSpec, topology):
    """The named policy, its trained predictor loaded from the first matching --predictor-dir."""
    from moestream.policies import POLICIES
    from moestream.policies.trained import TrainedPolicy, load_matching

    policy = POLICIES.create(spec.policy, topology)
    if load_matching(policy, spec.predictor_dirs) is None and isinstance(policy, TrainedPolicy):
        raise MoestreamError(f"policy {spec.policy!r} needs a trained predictor of kind {policy.predictor.kind!r} "
                             "(--predictor-dir)")
    return policy


@RUNS.register("engine")
class EngineRun:
    """Our engine on the spec's prompts, one generation per prompt."""

    def run(self, spec: RunSpec) -> dict:
        from moestream.bench.tools.bandwidth import drop_page_cache
        from moestream.checkpoint.index import build_index
        from moestream.runtime import Engine, EngineConfig

        drop_page_cache(shards(spec.model))
        policy = make_policy(spec, build_index(spec.model).topology)
        config = EngineConfig(device=spec.device, expert_budget=spec.budget, host_budget=spec.host_budget,
                              direct_io=spec.direct_io, sync=spec.sync, policy=spec.policy,
                              replay_routing=spec.replay_routing, reorder=spec.reorder, link_gbps=spec.link_gbps,
                              layer_ms=spec.layer_ms, background_predictor=spec.background_predictor,
                              native_gemv=spec.native_gemv, num_threads=spec.threads,
                              host_compute=spec.host_compute, host_threads=spec.host_threads)
        with Engine(spec.model, config, policy=policy) as engine:
            prepare(engine, spec)
            return self._generate(engine, spec)

    def _generate(self, engine, spec: RunSpec) -> dict:
        host = engine.experts.host  # None: --host-compute off
        if host is not None:
            host.placements = []  # each layer step's, for bench fidelity
        warm = sorted(engine.store.resident("device"))  # left by the warm-up (prepare), in the order it brought them
        warm_host = sorted(engine.store.resident("host"))  # the same for the host tier (fill_tiers)
        meter = DecodeMeter(engine.store, engine.tracer, spec.keep_embeddings,
                            (lambda: host.num_computed) if host is not None else (lambda: 0))
        counters = Counters()
        engine.add_observer(meter)
        stall_ms, prefill, token_ids = 0.0, [], []
        for prompt in spec.prompts:
            meter.start()
            result = engine.generate([prompt], spec.max_new_tokens)
            metrics = result.metrics
            meter.add_decode(counters, engine.store.stats(), metrics.host_computed)
            counters.ttft_ms.append(metrics.ttft_ms)
            if metrics.num_generated_tokens > 1:
                counters.tpot_ms.append(metrics.tpot_ms)
            counters.prompt_tokens += metrics.num_prompt_tokens
            stall_ms += _decode_stall_ms(metrics, spec, engine.store.stats(), meter, counters)
            prefill += [True] + [False] * (meter.steps - 1)
            token_ids.append(result.token_ids[0])
        replay = engine.replay
        if replay is not None and not replay.recorded_all:
            raise MoestreamError("bench engine: the run took more iterations than the routing replay records")
        return summarize(counters, stall_ms, counters.read_ms + counters.copy_ms, spec.warmup_steps) | {
            "replayed": replay is not None,
            "replay_wraps": replay.wraps if replay else 0,
            "iterations": [rows.tolist() for rows in replay.iterations] if replay else [],
            "iteration_token_ids": meter.token_ids,
            "iteration_tokens": meter.tokens,
            "prefill": prefill,
            "token_ids": token_ids,
            "device_slots": engine.store.device_slots,
            "host_slots": engine.store.host_slots,
            "warm_device": [[key.layer, key.expert] for key in warm],
            "warm_host": [[key.layer, key.expert] for key in warm_host],
        } | _placements(host) | ({"iteration_embeddings": meter.embeddings} if spec.keep_embeddings else {})


def _placements(host) -> dict:
    """Host compute's choice at each layer step and the cost figures it chose by (none: --host-compute off)."""
    if host is None:
        return {}
    return {"host_placements": [[layer, list(experts)] for layer, experts in host.placements],
            "host_costs": dataclasses.asdict(host.costs) if host.costs is not None else None}


def prepare(engine, spec: RunSpec) -> None:
    """Between opening an engine and generating: the preload of an all-resident run, the host tier's fill of
    a run with a host budget (host.py), and the checkpoint's pages dropped."""
    from moestream.bench.engine.host import fill_tiers
    from moestream.bench.tools.bandwidth import drop_page_cache

    if spec.preload:
        engine.preload()
    if Budget.parse(spec.host_budget).resolve(engine.checkpoint.topology.total_expert_bytes):
        fill_tiers(engine)
    drop_page_cache(shards(spec.model))


def _decode_stall_ms(metrics, spec: RunSpec, end, meter: DecodeMeter, counters: Counters) -> float:
    """This generation's decode stall. An engine without stall accounting (or --sync) moves every
    expert on the compute thread: the stall is the links' busy time (disk reads, host -> device copies).
    Otherwise the engine's whole-run stall, in the decode steps' share of the links' busy time."""
    if meter.at_decode is None:
        return 0.0
    busy_ms = lambda stats: (stats.disk_read_s + stats.copy_s) * 1e3
    decode_ms = busy_ms(end) - busy_ms(meter.at_decode)
    if spec.sync or metrics.stall_ms <= 0.0:
        return decode_ms
    return metrics.stall_ms * decode_ms / busy_ms(end) if busy_ms(end) > 0 else 0.0
