"""Continuous batching, a batching rule of the scheduler: sequences join and leave the running set
between steps (docs/design.md, Scheduling); and `open_scheduler`, the scheduler of a `BatchingConfig`.

Each step prefills waiting prompts or decodes one batch of running sequences (grouped by the token
scheduler). Each sequence keeps its own KV cache, merged into a decode batch's cache while the same
sequences decode together and split back when one leaves or is regrouped. Knows no request, model or HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moestream.config import BatchingConfig
from moestream.runtime import kv
from moestream.runtime.runner import BatchCache, Sequence
from moestream.runtime.scheduling.scheduler import Admission, ScheduledBatch, Scheduler, StaticBatches
from moestream.runtime.scheduling.token_scheduler import TOKEN_SCHEDULERS, RoutingPaths, TokenScheduler


@dataclass
class ContinuousBatches:
    max_batch_size: int  # sequences per decode step
    prefill_token_budget: int  # prompt tokens per prefill step (one longer prompt runs alone)
    max_prefill_delay_ms: float  # while sequences decode, a prompt waits up to this long to prefill
    grouping: TokenScheduler  # how running sequences are split into decode batches
    paths: RoutingPaths  # each sequence's routing path, for the grouping
    device: str
    clock: Callable[[], float] = time.perf_counter  # the clock of Sequence.arrived
    _own: dict[int, kv.SeqCache] = field(default_factory=dict)  # by seq id, outside any held batch
    _held: dict[tuple[int, ...], BatchCache] = field(default_factory=dict)  # merged caches by their seq ids
    _groups: list[list[int]] = field(default_factory=list)  # seq ids of the decode batches
    _turn: int = 0
    _last_prefill: bool = False

    def schedule(self, waiting: list[Sequence], running: list[Sequence]) -> ScheduledBatch | None:
        if waiting and not (self._last_prefill and running) and self._prefill_due(waiting, running):
            batch = ScheduledBatch(True, self._prefill_batch(waiting), BatchCache(kv.empty_cache()))
        elif running:
            batch = self._decode_batch(self._next_group(running))
        else:
            return None
        self._last_prefill = batch.is_prefill
        return batch

    def ran(self, batch: ScheduledBatch) -> None:
        """A prefill's cache is cut into its sequences' own; a decode batch's stays held."""
        if batch.is_prefill:
            lengths = [len(s.prompt_ids) for s in batch.seqs]
            self._own.update(zip((s.seq_id for s in batch.seqs), kv.split(batch.cache.kv, lengths)))

    def release(self, seq: Sequence) -> None:
        for key in [k for k in self._held if seq.seq_id in k]:
            self._split(key)
        self._own.pop(seq.seq_id, None)

    def cached_lengths(self) -> dict[int, int]:
        lengths = {seq_id: cache.length for seq_id, cache in self._own.items()}
        for key, held in self._held.items():
            lengths.update(zip(key, held.mask.sum(-1).tolist()))
        return lengths

    def cached_bytes(self) -> int:
        return sum(c.num_bytes for c in self._own.values()) + sum(kv.num_bytes(h.kv) for h in self._held.values())

    def _decode_batch(self, seqs: list[Sequence]) -> ScheduledBatch:
        key = tuple(s.seq_id for s in seqs)
        if key not in self._held:
            for other in [k for k in self._held if set(k) & set(key)]:
                self._split(other)
            cache, mask = kv.merge([self._own.pop(seq_id) for seq_id in key])
            self._held[key] = BatchCache(cache, mask.to(self.device))
        return ScheduledBatch(False, seqs, self._held[key])

    def _split(self, key: tuple[int, ...]) -> None:
        held = self._held.pop(key)
        self._own.update(zip(key, kv.split(held.kv, held.mask.sum(-1).tolist())))

    def _prefill_due(self, waiting: list[Sequence], running: list[Sequence]) -> bool:
        oldest = min(seq.arrived for seq in waiting)
        return not running or (self.clock() - oldest) * 1e3 >= self.max_prefill_delay_ms

    def _prefill_batch(self, waiting: list[Sequence]) -> list[Sequence]:
        batch, tokens = [], 0
        for seq in waiting[: self.max_batch_size]:
            if batch and tokens + len(seq.prompt_ids) > self.prefill_token_budget:
                break
            batch.append(seq)
            tokens += len(seq.prompt_ids)
        return batch

    def _next_group(self, running: list[Sequence]) -> list[Sequence]:
        """The next decode batch in turn; batches are regrouped when the running set changed."""
        by_id = {s.seq_id: s for s in running}
        if sorted(by_id) != sorted(i for group in self._groups for i in group):
            paths = np.stack([self.paths.path(s.seq_id) for s in running])  # [N, L * E]
            self._groups = [[running[row].seq_id for row in group]
                            for group in self.grouping.group(paths, self.max_batch_size)]
            self._turn = 0
        group = self._groups[self._turn % len(self._groups)]
        self._turn += 1
        return [by_id[i] for i in group]


def open_scheduler(engine, config: BatchingConfig, clock: Callable[[], float] = time.perf_counter) -> Scheduler:
    """A scheduler on the engine: continuous batches with the KV budget where the runner keeps per-sequence
    caches (routing paths observed until it closes), else static batches; clock: Sequence.arrived's."""
    if not engine.per_sequence_cache:
        return engine.scheduler(StaticBatches(config.max_batch_size), admission=Admission(config.num_seqs))
    admission = Admission(config.num_seqs, config.kv_budget_bytes, engine.kv_bytes_per_token())
    paths = RoutingPaths(engine.checkpoint.topology)
    rule = ContinuousBatches(config.max_batch_size, config.prefill_token_budget, config.max_prefill_delay_ms,
                             TOKEN_SCHEDULERS.create(config.token_scheduler), paths, engine.config.device, clock)
    engine.add_observer(paths)
    return engine.scheduler(rule, admission=admission, paths=paths, detach=lambda: engine.remove_observer(paths))
