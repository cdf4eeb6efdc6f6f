"""The offloading engine: a checkpoint's dense part on the compute device, its experts in the store,
routing events for the policy, and `step`, the one forward pass of every way of generating.

`step(scheduler)` is schedule -> forward -> postprocess: the scheduler picks the sequences and their
cache; the runner plans the inputs (`StepPlan`), the engine announces it (`IterationContext`) and lets
the policy predict, the runner runs the model (each MoE layer publishes its routing, fetches misses and
computes); the scheduler appends the tokens and ends sequences. `generate`, the `LLM` API and the server
all loop on `step`. The engine knows no policy (taken by registry name), no family and no request.

Under expert parallelism the engine is one rank's (runtime/sharding.py). On the CPU it bounds oneDNN's
per-shape caches (runtime/onednn.py); while open, torch computes on `config.num_threads` threads and
numpy's BLAS on one (`moestream.threads.ComputeThreads`; process-wide, restored by close).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from typing import Sequence as Seq

import numpy as np
import torch

from moestream.checkpoint.index import CheckpointIndex, build_index
from moestream.checkpoint.manifest import load_manifest
from moestream.checkpoint.tokenizer import load_tokenizer
from moestream.config import EngineConfig
from moestream.contracts import Observer, Policy, TransferRequest
from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.policies.driver import PolicyDriver
from moestream.progress import progress_bar
from moestream.quant.kernels import quant_kernel
from moestream.runtime import kv
from moestream.runtime.background import offload_predictor
from moestream.runtime.experts import attach_replay, bind_experts
from moestream.runtime.finite import FiniteFlags
from moestream.runtime.host_compute import host_compute_for
from moestream.runtime.host_reads import HostReads, upload
from moestream.runtime.loader import dense_modules, expert_decoder, generation_config, load_model
from moestream.runtime.metrics import GenerationMetrics, StepClock
from moestream.runtime.offload import OffloadedExperts, Prefetcher, modelled_link
from moestream.runtime.onednn import NativeGemv, bound_shape_caches
from moestream.runtime.publisher import Publisher
from moestream.runtime.replay import ReplayError, RoutingReplay, load_replay
from moestream.runtime.runner import NO_TOKEN_LIMIT, RUNNERS, BatchCache, ModelRunner, Sequence, StepPlan, TokenSampler
from moestream.runtime.scheduling.scheduler import BatchingRule, ScheduledBatch, Scheduler, StaticBatches, eos_ids
from moestream.runtime.sharding import ALONE, Shard, StepAnnouncer
from moestream.store.config import StoreConfig
from moestream.store.factory import open_store
from moestream.store.store import TIERS, ExpertStore
from moestream.threads import ComputeThreads
from moestream.topology import ExpertKey
from moestream.tracer import Tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    seq_ids: list[int]
    token_ids: list[list[int]]  # generated ids of each prompt (prompt excluded; EOS kept when emitted)
    texts: list[str]  # decoded generated text of each prompt ("" without a tokenizer)
    metrics: GenerationMetrics
    replayed: bool = False  # routing came from a recorded trace (config.replay_routing): for measurement only


@dataclass(frozen=True)
class StepOutput:
    batch: ScheduledBatch
    tokens: list[int | None]  # each row's new token (None: its sequence had ended before the step)


class Engine:
    """One checkpoint served with its experts offloaded. Observers (here or add_observer) see every
    iteration context and routing event beside the policy's; close() releases the store's files and threads."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 observers: Seq[Observer] = (), progress: bool = False, policy: Policy | None = None,
                 shard: Shard | None = None, steps: StepAnnouncer | None = None, tracer: Tracer | None = None):
        """policy: a built (e.g. fitted) policy instead of config.policy; shard: the experts this rank owns
        (None: all); steps: told of every forward pass; tracer: where parts report (None: totals only)."""
        self.config = config or EngineConfig()
        self.tracer = tracer if tracer is not None else Tracer()
        self.shard, self.steps = shard, steps or ALONE
        if self.config.device == "cpu":
            bound_shape_caches()
        self.checkpoint: CheckpointIndex = build_index(model_dir)
        quant = quant_kernel(self.config.quant_kernel, self.checkpoint, self.config.device)  # refuses what it can't run
        self.policy = policy or _make_policy(self.config, self.checkpoint.topology)
        self._background = offload_predictor(self.policy, not self.config.background_predictor,  # before observers()
                                             self.config.transfer_timeout_s)
        evictions = {tier: self.policy.make_eviction(tier) for tier in TIERS}
        self.store: ExpertStore = open_store(self.checkpoint.experts, StoreConfig.of(self.config),
                                             evictions["device"], evictions["host"], load_manifest(self.checkpoint),
                                             tracer=self.tracer)
        self.driver = PolicyDriver(self.policy, list(evictions.values()), observers, self.config.horizon_layers,
                                   self.tracer)
        self.publisher = Publisher(self.driver, always_hidden=self.config.publish_hidden)
        self.prefetcher = Prefetcher(self.driver, self.store, shard)
        self.store.model_link(modelled_link(self.config, self.checkpoint.topology))
        self.reads = HostReads()  # every device-to-host read of a step goes through it (runtime/host_reads.py)
        self.finite = FiniteFlags.of_layers(self.checkpoint.topology.moe_layer_ids, self.config.device, self.reads)
        decode = quant(expert_decoder(self.checkpoint, self.config.device), self.checkpoint)
        self.experts = OffloadedExperts(self.store, self.publisher, self.prefetcher, self.config.reorder, shard=shard,
                                        decode=decode, tracer=self.tracer, reads=self.reads, finite=self.finite)
        self.experts.host = host_compute_for(self.config, self.store, lambda: expert_decoder(self.checkpoint, "cpu"))
        self._hooks: list = []
        self._native = NativeGemv(self.config.native_gemv, self.config.device)
        self.runner: ModelRunner | None = None
        self._tokenizer = None
        self._seq_counter = itertools.count()
        self._step_counter = itertools.count()
        self.replay: RoutingReplay | None = None
        beside = int(self._background is not None and not self._background.synchronous)  # a predictor thread
        self.threads = ComputeThreads(self.config.num_threads,  # after the policy's imports
                                      self.store.executor.num_threads + beside)
        try:
            self.model = self._load_model(progress)
            self.runner = RUNNERS.create(self.checkpoint.adapter.auto_class, self.model, self.publisher,
                                         self.pad_id, self.config.device)
            self.replay = self._replay()
            if self.store.device_slots >= len(self.owned_keys()):
                self.preload(progress)
        except BaseException:
            self.close()
            raise

    def _load_model(self, progress: bool) -> torch.nn.Module:
        model = load_model(self.checkpoint, self.config.device, progress)
        model.generation_config = generation_config(self.checkpoint)
        self._hooks = bind_experts(model, self.checkpoint, self.experts, self.config.publish_gate_probs)
        self._hooks += self._native.keep_onednn(dense_modules(model).get("attention", []))  # runtime/onednn.py
        topology = self.checkpoint.topology
        log.info("loaded %s on %s: %d MoE layers x %d experts, %d device slots, %d host slots",
                 self.checkpoint.path, self.config.device, topology.num_layers, topology.num_experts,
                 self.store.device_slots, self.store.host_slots)
        return model

    def _replay(self) -> RoutingReplay | None:
        if self.config.replay_routing is None:
            return None
        if not self.records_traces:
            raise ReplayError(f"{self.checkpoint.adapter.model_type} routes its encoder and decoder tokens "
                              "apart; routing replay needs a decoder-only model")
        replay = load_replay(self.config.replay_routing, self.checkpoint.topology)
        attach_replay(self.model, replay)
        self.add_observer(replay)
        return replay

    # -- public ----------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.checkpoint.path)
        return self._tokenizer

    @property
    def records_traces(self) -> bool:
        """Whether routing events cover each iteration's tokens at every MoE layer (trace recording)."""
        return self.runner_class.records_traces

    def preload(self, progress: bool = False) -> int:
        """Fills the device tier with experts in layer order, a layer at a time; how many were brought in."""
        keys = self.owned_keys()[: self.store.device_slots]
        brought = 0
        with progress_bar(total=len(keys), desc="loading experts", unit="expert", disable=not progress) as bar:
            for _, group in itertools.groupby(keys, key=lambda key: key.layer):
                group = list(group)
                brought += len(self.store.prefetch([TransferRequest(key, 1.0) for key in group]))
                self.store.wait_idle()
                bar.update(len(group))
        return brought

    def owned_keys(self) -> list[ExpertKey]:
        """The experts this engine computes, in layer order: all of them, or its shard's."""
        keys = list(self.checkpoint.topology.keys())
        return keys if self.shard is None else [key for key in keys if self.shard.owns(key)]

    def reset_stats(self) -> None:
        self.store.reset_stats()
        self.steps.reset_stats()

    def add_observer(self, observer: Observer) -> None:
        self.driver.add_observer(observer)

    def remove_observer(self, observer: Observer) -> None:
        self.driver.observers.remove(observer)

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids with the checkpoint's tokenizer (no chat template)."""
        return list(self.tokenizer(prompt)["input_ids"])

    def generate(self, prompts: Seq[str] | Seq[Seq[int]], max_new_tokens: int = 32,
                 on_tokens: Callable[[list[int | None]], None] | None = None) -> GenerationResult:
        """Greedy generation for prompts (text or ids) as one static batch; on_tokens gets each step's tokens."""
        if max_new_tokens < 1:
            raise MoestreamError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        seqs = [self.new_sequence(ids, max_new_tokens) for ids in self.prompt_ids(prompts)]
        scheduler = self.scheduler(StaticBatches(len(seqs)))
        for seq in seqs:
            scheduler.add(seq)
        self.reset_stats()
        clock = StepClock()
        while (out := self.step(scheduler)) is not None:
            if on_tokens is not None:
                on_tokens(out.tokens)
            clock.mark()
        return self._result(seqs, clock, isinstance(prompts[0], str))

    def close(self) -> None:
        try:
            for hook in self._hooks:
                hook.remove()
            if self._background is not None:
                self._background.close()
            self.experts.close()
        finally:
            try:
                self.store.close()
            finally:
                self.threads.restore()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the step loop --------------------------------------------------------------------------

    @property
    def runner_class(self) -> type[ModelRunner]:
        return RUNNERS.get(self.checkpoint.adapter.auto_class)

    @property
    def per_sequence_cache(self) -> bool:
        """Whether batches can be merged from per-sequence caches (continuous batching)."""
        return self.runner_class.per_sequence_cache and kv.mergeable(self.model)

    def new_sequence(self, prompt_ids: list[int], max_tokens: int = NO_TOKEN_LIMIT,
                     sampler: TokenSampler | None = None, ignore_eos: bool = False) -> Sequence:
        """A sequence with a fresh id (sampler None: greedy); max_tokens is capped to the context left."""
        return Sequence(next(self._seq_counter), list(prompt_ids), self._within_context(len(prompt_ids), max_tokens),
                        sampler, ignore_eos)

    @property
    def context_len(self) -> int | None:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def _within_context(self, num_prompt: int, max_tokens: int) -> int:
        context = self.context_len
        if context is None or num_prompt + max_tokens <= context:
            return max_tokens
        if num_prompt >= context:
            raise MoestreamError(f"the prompt has {num_prompt} tokens; this model's context is {context} tokens "
                                 "(max_position_embeddings)")
        if max_tokens < NO_TOKEN_LIMIT:  # a caller's limit is capped with a warning; no limit, silently
            log.warning("moestream: max new tokens capped at %d: the prompt's %d tokens and the model's context "
                        "of %d leave no more", context - num_prompt, num_prompt, context)
        return context - num_prompt

    def scheduler(self, rule: BatchingRule, **options) -> Scheduler:
        return Scheduler(rule, eos_ids(self.model.generation_config), self.end_sequence, **options)

    def step(self, scheduler: Scheduler) -> StepOutput | None:
        """One schedule -> forward -> postprocess (None: nothing to run); a batch that raises stays `in_flight`."""
        batch = scheduler.schedule()
        if batch is None:
            return None
        return StepOutput(batch, scheduler.postprocess(batch, self._forward(batch)))

    def kv_bytes_per_token(self) -> int:
        """The KV cache bytes of one token, measured by a one-token prefill outside replay: exact where a
        formula over the config is not (DeepSeek's attention caches its compressed latents)."""
        seq = self.new_sequence([self.pad_id])
        batch = ScheduledBatch(True, [seq], BatchCache(kv.empty_cache()))
        try:
            with self.replay.paused() if self.replay is not None else contextlib.nullcontext():
                self._forward(batch)
            (cache,) = kv.split(batch.cache.kv, [1])
        finally:
            self.end_sequence(seq.seq_id)
        return cache.num_bytes

    def end_sequence(self, seq_id: int) -> None:
        self.publisher.end_sequence(seq_id)
        self.steps.ended(seq_id)

    # -- steps -----------------------------------------------------------------------------------

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        self.steps.announce(batch, self.replay is not None and self.replay.is_paused)
        return self.forward(batch)

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Next-token logits [B, V] on the host (the step's one read beside its layers')."""
        step, seqs = next(self._step_counter), batch.seqs
        with torch.inference_mode():
            plan = self.runner.prefill(step, seqs) if batch.is_prefill else self.runner.decode(step, seqs, batch.cache)
            self._begin(plan)
            with self._native.step(plan.input_ids.numel()):
                logits, hits = self.finite.read(self.runner.run(plan, batch.cache), self.experts.resident_hits)
            self.store.count_hits(self.experts.take_resident_hits(hits))  # all-resident layers' lookups
            return logits  # [B, V] on the host, checked

    def _begin(self, plan: StepPlan) -> None:
        ctx = plan.ctx
        self.finite.begin()
        self.experts.resident_hits.zero_()  # a step that raised may have left counts
        if self.publisher.needs_embeddings:
            embeddings = self.model.get_input_embeddings()(plan.input_ids)  # [B, S, H]
            active = upload(np.flatnonzero(plan.rows.active), embeddings.device)  # not a mask: no wait
            rows = embeddings.reshape(plan.rows.num_rows, -1).index_select(0, active)  # [T, H]
            ctx = dataclasses.replace(ctx, embeddings=self.reads.read(rows)[0])
        if self._tokenizer is not None:
            ctx = dataclasses.replace(ctx, tokens=tuple(self._tokenizer.convert_ids_to_tokens(list(ctx.token_ids))))
        self.publisher.begin_iteration(ctx)
        self.prefetcher.after(-1)

    def _result(self, seqs: list[Sequence], clock: StepClock, decode_text: bool) -> GenerationResult:
        stats = self.store.stats()
        metrics = GenerationMetrics(
            ttft_ms=clock.ttft_ms, tpot_ms=clock.tpot_ms, expert_hits=stats.hits, expert_misses=stats.misses,
            bytes_read=dict(stats.bytes_read), num_prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
            num_generated_tokens=sum(len(s.output_ids) for s in seqs), stall_ms=stats.stall_s * 1e3,
            transfer_ms=stats.transfer_s * 1e3, host_computed=self.experts.take_host_computed())
        texts = [self.tokenizer.decode(s.output_ids, skip_special_tokens=True) if decode_text else "" for s in seqs]
        return GenerationResult([s.seq_id for s in seqs], [list(s.output_ids) for s in seqs], texts, metrics,
                                replayed=self.replay is not None)

    # -- inputs ----------------------------------------------------------------------------------

    def prompt_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or not prompts:
            raise MoestreamError("generate needs a non-empty list of prompts")
        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        vocab = self.model.config.get_text_config().vocab_size
        for row in ids:
            if not row:
                raise MoestreamError("a prompt has no tokens")
            if min(row) < 0 or max(row) >= vocab:
                raise MoestreamError(f"prompt token ids must lie in [0, {vocab})")
        return ids

    @property
    def pad_id(self) -> int:
        """The token that left-pads shorter prompts of a batch."""
        pad = self.model.generation_config.pad_token_id
        pad = self.model.config.get_text_config().pad_token_id if pad is None else pad
        return int(pad) if pad is not None else min(eos_ids(self.model.generation_config), default=0)


def _make_policy(config: EngineConfig, topology) -> Policy:
    if config.predictor_dir is None:
        return POLICIES.create(config.policy, topology)
    try:
        return POLICIES.create(config.policy, topology, predictor_dir=config.predictor_dir)
    except TypeError:
        raise MoestreamError(f"policy {config.policy!r} has no trained predictor to load") from None
