"""What one `bench engine` run executes, by kind: our engine, or transformers with accelerate's disk
offload at the same memory. Each returns the figures of `spec.summarize` plus what the caller needs
(the routing replay's rows, for the simulator). Both start cold: the checkpoint's pages (and
accelerate's offload folder) are dropped from the page cache after loading, before generating.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moestream.bench.engine.spec import Counters, RunSpec, dense_bytes, shards, summarize
from moestream.errors import MoestreamError
from moestream.policies.contracts import Observer
from moestream.registry import Registry

RUNS: Registry = Registry("bench engine run kind")


class DecodeMeter(Observer):
    """Snapshots the store's counters and the engine tracer's totals when a generation's first decode
    step begins; keeps each iteration's token ids, strings and, if asked (keep_embeddings), embeddings
    where the engine gave them (what the policy saw, for the simulator)."""

    def __init__(self, store, tracer, keep_embeddings: bool = False):
        self.store, self.tracer, self.keep_embeddings = store, tracer, keep_embeddings
        self.steps = 0
        self.decode_tokens = 0
        self.at_decode = None  # StoreStats at the start of the first decode step
        self.totals_at_decode = None  # the tracer's totals then
        self.token_ids: list[list[int]] = []  # per iteration of every generation
        self.tokens: list[list[str]] = []  # their strings (empty where the engine has no tokenizer)
        self.embeddings: list[list[list[float]]] = []  # [T, H] each (empty where no observer asked for them)

    def start(self) -> None:
        self.steps, self.decode_tokens, self.at_decode = 0, 0, None

    def begin_iteration(self, ctx) -> None:
        self.steps += 1
        self.token_ids.append(ctx.token_ids.tolist())
        self.tokens.append(list(ctx.tokens or ()))
        if self.keep_embeddings:
            self.embeddings.append([] if ctx.embeddings is None else ctx.embeddings.tolist())
        if self.steps == 2:
            self.at_decode, self.totals_at_decode = self.store.stats(), self.tracer.totals()
        if self.steps >= 2:
            self.decode_tokens += ctx.num_tokens

    def add_decode(self, counters: Counters, end) -> None:
        """Adds the decode steps' counters (the store's at the end minus at the first decode step)."""
        if self.at_decode is None:
            return
        from moestream.runtime.offload import expert_compute

        start = self.at_decode
        counters.hits += end.hits - start.hits
        counters.misses += end.misses - start.misses
        counters.disk_bytes += end.bytes_read["disk"] - start.bytes_read["disk"]
        counters.read_ms += (end.disk_read_s - start.disk_read_s) * 1e3
        counters.read_batches += end.disk_batches - start.disk_batches
        counters.read_fit = counters.read_fit.plus(end.read_fit.since(start.read_fit))
        experts, seconds = expert_compute(self.tracer.totals(), self.totals_at_decode)
        counters.experts_computed += experts
        counters.expert_compute_ms += seconds * 1e3
        counters.decode_tokens += self.decode_tokens


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
    """Our engine on the spec's prompts, one generation per prompt; on ranks (ranks given: this is rank 0
    of a run under torchrun, ranked.py), rank 0's engine, with every rank's figures summed over the
    generations (`expert_parallel`)."""

    def run(self, spec: RunSpec, ranks=None) -> dict:
        from moestream.checkpoint.index import build_index
        from moestream.policies.trained import matching_directory
        from moestream.runtime import EngineConfig
        from moestream.store.bandwidth import drop_page_cache

        drop_page_cache(shards(spec.model))
        policy = make_policy(spec, build_index(spec.model).topology)
        trained = matching_directory(policy, spec.predictor_dirs)  # for the other ranks, which make their own
        config = EngineConfig(device=spec.device, expert_budget=spec.budget, direct_io=spec.direct_io, sync=spec.sync,
                              policy=spec.policy, predictor_dir=None if trained is None else str(trained),
                              replay_routing=spec.replay_routing, reorder=spec.reorder, link_gbps=spec.link_gbps,
                              layer_ms=spec.layer_ms, background_predictor=spec.background_predictor,
                              native_gemv=spec.native_gemv)
        with _engine(spec, config, policy, ranks) as engine:
            prepare(engine, spec, ranks)
            return self._generate(engine, spec)

    def _generate(self, engine, spec: RunSpec) -> dict:
        from moestream.parallel.launch import expert_parallel_report

        meter, counters = DecodeMeter(engine.store, engine.tracer, spec.keep_embeddings), Counters()
        engine.add_observer(meter)
        stall_ms, prefill, token_ids, parallel = 0.0, [], [], []
        for prompt in spec.prompts:
            meter.start()
            result = engine.generate([prompt], spec.max_new_tokens)
            metrics = result.metrics
            meter.add_decode(counters, engine.store.stats())
            counters.ttft_ms.append(metrics.ttft_ms)
            if metrics.num_generated_tokens > 1:
                counters.tpot_ms.append(metrics.tpot_ms)
            counters.prompt_tokens += metrics.num_prompt_tokens
            stall_ms += _decode_stall_ms(metrics, spec, engine.store.stats(), meter, counters)
            prefill += [True] + [False] * (meter.steps - 1)
            token_ids.append(result.token_ids[0])
            parallel.append(expert_parallel_report(engine))  # None on one process
        replay = engine.replay
        if replay is not None and not replay.recorded_all:
            raise MoestreamError("bench engine: the run took more iterations than the routing replay records")
        return summarize(counters, stall_ms, counters.read_ms) | {
            "replayed": replay is not None,
            "replay_wraps": replay.wraps if replay else 0,
            "iterations": [rows.tolist() for rows in replay.iterations] if replay else [],
            "iteration_token_ids": meter.token_ids,
            "iteration_tokens": meter.tokens,
            "prefill": prefill,
            "token_ids": token_ids,
            "device_slots": engine.store.device_slots,
        } | ({"iteration_embeddings": meter.embeddings} if spec.keep_embeddings else {}) | (
            {} if parallel[0] is None else {"expert_parallel": summed_report(parallel)})


def prepare(engine, spec: RunSpec, ranks=None) -> None:
    """Between opening an engine and generating, on every rank: the preload of an all-resident run, the
    checkpoint's pages dropped, and on ranks a wait for all (one done preloading first would time out
    waiting for the first step)."""
    from moestream.parallel.ranks import wait_for_all
    from moestream.store.bandwidth import drop_page_cache

    if spec.preload:
        engine.preload()
    drop_page_cache(shards(spec.model))
    if ranks is not None:
        wait_for_all(ranks, "the preloading of the experts")


def summed_report(reports: list[dict]) -> dict:
    """Every rank's figures (moestream.parallel.launch.expert_parallel_report) summed over generations."""
    ranks = []
    for per_rank in zip(*(report["ranks"] for report in reports)):
        hits, misses = sum(r["hits"] for r in per_rank), sum(r["misses"] for r in per_rank)
        read = {tier: sum(r["bytes_read"].get(tier, 0) for r in per_rank) for tier in per_rank[0]["bytes_read"]}
        ranks.append(per_rank[0] | {"hits": hits, "misses": misses, "bytes_read": read,
                                    "hit_rate": hits / max(hits + misses, 1),
                                    "combine_s": sum(r["combine_s"] for r in per_rank)})
    return reports[0] | {"ranks": ranks}


def _engine(spec: RunSpec, config, policy, ranks):
    from moestream.parallel.config import ParallelConfig
    from moestream.parallel.launch import leading_engine
    from moestream.runtime import Engine

    if ranks is None:
        return Engine(spec.model, config, policy=policy)
    parallel = ParallelConfig(expert_parallel_placement=spec.expert_parallel_placement,
                              expert_parallel_trace=spec.expert_parallel_trace)
    return leading_engine(spec.model, config, parallel, ranks, policy=policy)


def _decode_stall_ms(metrics, spec: RunSpec, end, meter: DecodeMeter, counters: Counters) -> float:
    """This generation's decode stall. An engine without stall accounting (or --sync) reads every
    expert on the compute thread: the stall is the reader's busy time. Otherwise the engine's
    whole-run stall, in the decode steps' share of the reader's busy time."""
    if meter.at_decode is None:
        return 0.0
    decode_read_ms = (end.disk_read_s - meter.at_decode.disk_read_s) * 1e3
    if spec.sync or metrics.stall_ms <= 0.0:
        return decode_read_ms
    total_read_ms = end.disk_read_s * 1e3
    return metrics.stall_ms * decode_read_ms / total_read_ms if total_read_ms > 0 else 0.0


@RUNS.register("hf-accelerate")
class HfAccelerateRun:
    """transformers with accelerate's disk offload: what fits in dense part + budget stays in memory, the
    rest of the weights is read from an offload folder at every forward. Routing is the model's own (no
    replay without patching transformers); offloaded modules hold a whole layer's experts, so the bytes
    read do not depend on routing."""

    def run(self, spec: RunSpec, ranks=None) -> dict:
        import transformers

        from moestream.checkpoint.index import build_index
        from moestream.store.bandwidth import drop_page_cache
        from moestream.store.config import Budget

        topology = build_index(spec.model).topology
        budget = Budget.parse(spec.budget).resolve(topology.total_expert_bytes)
        folder = Path(spec.scratch_dir) / "offload"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec.model, device_map="auto", max_memory={"cpu": dense_bytes(spec.model, topology) + budget}, offload_folder=str(folder),
            dtype="auto").eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(spec.model)
        os.sync()  # the offload folder was just written: dirty pages cannot be dropped
        drop_page_cache([*shards(spec.model), *folder.glob("*")])
        counters = Counters()
        for prompt in spec.prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # [1, S]
            _generate_timed(model, ids, spec.max_new_tokens, counters)
        return summarize(counters, 0.0, 0.0) | {"replayed": False, "stall_ms_per_token": None, "hit_rate": None}


def _generate_timed(model, ids, max_new_tokens: int, counters: Counters) -> None:
    """One greedy generation, timed per step by a logits processor; disk bytes of the decode steps."""
    import torch
    from transformers import LogitsProcessorList

    marks = StepMarks()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([marks]))
    generated = out.shape[1] - ids.shape[1]
    counters.ttft_ms.append((marks.times[0] - started) * 1e3)
    if generated > 1:
        counters.tpot_ms.append((marks.times[-1] - marks.times[0]) * 1e3 / (len(marks.times) - 1))
        counters.disk_bytes += _read_bytes() - marks.read_bytes_at_first
        counters.decode_tokens += generated - 1
    counters.prompt_tokens += ids.shape[1]


class StepMarks:
    """A logits processor that notes when each step's logits are ready (and the disk bytes at the first)."""

    def __init__(self):
        self.times: list[float] = []
        self.read_bytes_at_first = 0

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if len(self.times) == 1:
            self.read_bytes_at_first = _read_bytes()
        return scores


def _read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0
