"""Continuous batching: sequences join and leave the running set between steps.

Each step is schedule -> run -> update over plain records. `admit` takes a request in while the
running set stays within max_num_seqs and its reserved KV bytes (prompt + max_tokens per sequence)
within kv_budget_bytes; the KV bytes of a token are measured at construction by a one-token prefill
that no request sees, so the budget holds from the first request on. `schedule` drops cancelled
sequences, then picks either one prefill (the waiting prompts, up to prefill_token_budget tokens) or
one decode of a batch of running sequences; a prefill never runs twice in a row while sequences
decode, so decode latency stays bounded by one prefill while prompts arrive. With offloaded experts
a prefill reads most of every layer's experts, so each one that lands between decode steps costs the
running sequences about a sweep of the experts: with max_prefill_delay_ms, prompts that arrive while
sequences decode wait (up to that long since they arrived, or until the running sequences finish)
and then prefill together, one sweep for all of them, trading time to first token for time per
output token. When more sequences run than max_batch_size, the token scheduler splits them into
batches that decode in turn. Each sequence keeps its own KV cache (runtime/kv.py), merged into a
decode batch's cache when the batch first runs; that merged cache is held while the same sequences
decode together (no copy per step) and split back into the sequences' own caches only when one of
them leaves or is regrouped. Sequences that leave end their state in the policy
(`Engine.end_sequence`). The batcher knows no HTTP and no queue.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from moestream.errors import MoestreamError
from moestream.runtime import kv
from moestream.runtime.engine import eos_ids
from moestream.runtime.runner import Sequence, merged_decode_plan, prefill_plan
from moestream.serving.generation import TextDelta, TextStream
from moestream.serving.sampling import BatchSampler
from moestream.serving.token_scheduler import TOKEN_SCHEDULERS, RoutingPaths

if TYPE_CHECKING:
    from moestream.serving.worker import Request

log = logging.getLogger(__name__)


class KvBudgetError(MoestreamError):
    """A request needs more KV cache than the whole budget."""


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = 16  # sequences per decode step
    max_num_seqs: int = 0  # running sequences at most (0: max_batch_size); above a batch, batches alternate
    kv_budget_bytes: int = 1 << 30  # KV cache reserved by the running sequences at most
    prefill_token_budget: int = 2048  # prompt tokens per prefill step (one longer prompt runs alone)
    token_scheduler: str = "fifo"  # how running sequences are split into batches (TOKEN_SCHEDULERS)
    max_prefill_delay_ms: float = 0.0  # while sequences decode, a prompt waits up to this long to prefill

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_num_seqs < 0 or self.prefill_token_budget < 1:
            raise MoestreamError("max_batch_size and prefill_token_budget must be >= 1, max_num_seqs >= 0")
        if not self.max_prefill_delay_ms >= 0:
            raise MoestreamError(f"max_prefill_delay_ms must be >= 0, got {self.max_prefill_delay_ms}")
        if self.kv_budget_bytes < 1:
            raise MoestreamError(f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        if self.token_scheduler not in TOKEN_SCHEDULERS:
            raise MoestreamError(f"unknown token scheduler {self.token_scheduler!r}; "
                                 f"choose from {', '.join(TOKEN_SCHEDULERS.names())}")

    @property
    def num_seqs(self) -> int:
        return self.max_num_seqs or self.max_batch_size


@dataclass(eq=False)
class Slot:
    """A running sequence: its request, engine sequence, sampler, text stream and KV cache."""

    request: Request
    seq: Sequence
    sampler: BatchSampler
    stream: TextStream
    reserved_bytes: int = 0
    prefilled: bool = False
    cache: kv.SeqCache | None = None  # its own cache; None before its prefill and while a HeldBatch holds it


@dataclass(frozen=True)
class Step:
    is_prefill: bool
    slots: list[Slot]


@dataclass
class HeldBatch:
    """A decode batch's merged cache, kept between its steps while the same sequences decode together."""

    slots: list[Slot]
    cache: object  # the batch's DynamicCache, left padded
    mask: torch.Tensor  # [B, W] each row's cached positions
    lengths: list[int]  # each row's own cached positions (W less its left padding)


@dataclass
class ContinuousBatcher:
    engine: object
    config: BatchingConfig
    on_delta: Callable[[Request, TextDelta, bool], None]  # (request, delta, with a new token)
    slots: list[Slot] = field(default_factory=list)
    bytes_per_token: int = field(init=False)  # KV cache of one token, measured by a dry prefill at start
    clock: Callable[[], float] = time.perf_counter  # the clock of Request.arrived
    _groups: list[list[int]] = field(default_factory=list)  # seq ids of the decode batches
    _held: dict[tuple[int, ...], HeldBatch] = field(default_factory=dict)  # by the batch's seq ids
    _turn: int = 0
    _last_prefill: bool = False

    def __post_init__(self):
        if not self.engine.runner_class.per_sequence_cache:
            raise MoestreamError(f"continuous batching needs a decoder-only model; "
                                 f"{self.engine.checkpoint.adapter.model_type} is not one")
        self.runner = self.engine.make_runner()
        self.bytes_per_token = self._kv_bytes_per_token()
        self.scheduler = TOKEN_SCHEDULERS.create(self.config.token_scheduler)
        self.paths = RoutingPaths(self.engine.checkpoint.topology)
        self.engine.add_observer(self.paths)
        self.eos = eos_ids(self.engine.model.generation_config)
        self.decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    def cached_lengths(self) -> dict[int, int]:
        """Each sequence's cached positions over every KV cache the batcher holds (its own, or merged
        into a held batch): a finished sequence is in none."""
        lengths = {s.seq.seq_id: s.cache.length for s in self.slots if s.cache is not None}
        for held in self._held.values():
            lengths.update({s.seq.seq_id: n for s, n in zip(held.slots, held.lengths)})
        return lengths

    # -- admission -------------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self.slots)

    def need_bytes(self, request: Request) -> int:
        return (len(request.prompt_ids) + request.params.max_tokens) * self.bytes_per_token

    def can_admit(self, request: Request) -> bool:
        """Room for the request: a free slot and its KV bytes within the budget."""
        if len(self.slots) >= self.config.num_seqs:
            return False
        return self.reserved_bytes + self.need_bytes(request) <= self.config.kv_budget_bytes

    def fits(self, request: Request) -> bool:
        """Whether the request fits the KV budget at all (alone)."""
        return self.need_bytes(request) <= self.config.kv_budget_bytes

    def admit(self, request: Request) -> None:
        need = self.need_bytes(request)
        if not self.fits(request):
            raise KvBudgetError(f"the request needs {need} bytes of KV cache, over the budget of "
                                f"{self.config.kv_budget_bytes}")
        sampler = BatchSampler([request.params], self.decode)
        request.attach(sampler, 0)
        slot = Slot(request, self.engine.new_sequence(request.prompt_ids), sampler, TextStream(request.params.stop), need)
        self.slots.append(slot)

    # -- schedule -> run -> update ---------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next step: a prefill of waiting prompts, or the next batch's decode (None: idle)."""
        for slot in [s for s in self.slots if s.request.cancelled]:
            self._finish(slot, "abort")
        waiting = [s for s in self.slots if not s.prefilled]
        running = [s for s in self.slots if s.prefilled]
        if waiting and not (self._last_prefill and running) and self._prefill_due(waiting, running):
            return Step(True, self._prefill_batch(waiting))
        if running:
            return Step(False, self._next_batch(running))
        return None

    def run(self, step: Step) -> torch.Tensor:
        """Runs the step's forward pass: next-token logits [B, V]; each row's cache is updated."""
        if not step.is_prefill:
            return self._decode(step.slots)
        seqs = [s.seq for s in step.slots]
        plan = prefill_plan(self.engine.next_step(), seqs, self.engine.pad_id, self.engine.config.device)
        self.runner.cache = kv.empty_cache()
        logits = self.engine.run_step(self.runner, plan)  # [B, V]
        for slot, cache in zip(step.slots, kv.split(self.runner.cache, [len(s.prompt_ids) for s in seqs])):
            slot.cache, slot.prefilled = cache, True
        self.runner.cache = None
        return logits

    def update(self, step: Step, logits: torch.Tensor) -> None:
        """Appends each row's token, streams its text and ends the sequences that are done."""
        self._last_prefill = step.is_prefill
        for row, slot in enumerate(step.slots):
            token = slot.sampler.choose(logits[row: row + 1], [slot.seq])[0]
            slot.seq.output_ids.append(int(token))
            stopped = slot.sampler.stops(0, slot.seq) or int(token) in self.eos
            reason = slot.sampler.finish_reason(0) if stopped else None
            if stopped:
                self._finish(slot, reason, emit=False)
            text = slot.sampler.text(0, slot.seq.output_ids)
            self.on_delta(slot.request, TextDelta(0, slot.stream.delta(text, stopped), stopped, reason), True)

    def step(self) -> bool:
        """One schedule -> run -> update; False when there was nothing to run."""
        step = self.schedule()
        if step is None:
            return False
        try:
            self.update(step, self.run(step))
        except Exception as error:  # the step's clients get the error; the batcher stays up
            log.exception("engine step failed")
            for slot in [s for s in step.slots if s in self.slots]:
                self._finish(slot, None, emit=False)
                slot.request.emit(error)
        return True

    def close(self) -> None:
        """Aborts every running sequence and stops observing the engine."""
        for slot in list(self.slots):
            self._finish(slot, "abort")
        if self.paths in self.engine.driver.observers:
            self.engine.remove_observer(self.paths)

    # -- helpers ---------------------------------------------------------------------------------

    def _kv_bytes_per_token(self) -> int:
        """The KV cache bytes of one token, from a prefill of one token that no request sees: exact
        whatever the family and the installed transformers keep (DeepSeek's attention caches its
        compressed latents, not the keys and values), where a formula over the config is not."""
        seq = self.engine.new_sequence([self.engine.pad_id])
        plan = prefill_plan(self.engine.next_step(), [seq], self.engine.pad_id, self.engine.config.device)
        self.runner.cache = kv.empty_cache()
        replay = self.engine.replay
        try:
            with replay.paused() if replay is not None else contextlib.nullcontext():  # it takes no trace rows
                self.engine.run_step(self.runner, plan)
            (cache,) = kv.split(self.runner.cache, [1])
        finally:
            self.runner.cache = None
            self.engine.end_sequence(seq.seq_id)
        return cache.num_bytes

    def _decode(self, slots: list[Slot]) -> torch.Tensor:
        """One token for each of the batch's sequences over its held cache (merged on its first step)."""
        key = tuple(s.seq.seq_id for s in slots)
        held = self._held.pop(key, None) or self._merge(slots)  # popped: a failed step holds nothing
        self.runner.cache = held.cache
        plan = merged_decode_plan(self.engine.next_step(), [s.seq for s in slots], held.mask, self.engine.config.device)
        try:
            logits = self.engine.run_step(self.runner, plan)  # [B, V]
            held.cache = self.runner.cache
        finally:
            self.runner.cache = None
        held.mask = torch.cat([held.mask, held.mask.new_ones((len(slots), 1))], dim=-1)  # [B, W + 1]
        held.lengths = [n + 1 for n in held.lengths]
        self._held[key] = held
        return logits

    def _merge(self, slots: list[Slot]) -> HeldBatch:
        for key in [k for k, held in self._held.items() if any(s in held.slots for s in slots)]:
            self._release(key)
        cache, mask = kv.merge([s.cache for s in slots])
        held = HeldBatch(slots, cache, mask, [s.cache.length for s in slots])
        for slot in slots:
            slot.cache = None  # the batch holds it now
        return held

    def _release(self, key: tuple[int, ...]) -> None:
        """Splits a held batch back into its sequences' own caches."""
        held = self._held.pop(key)
        for slot, cache in zip(held.slots, kv.split(held.cache, held.lengths)):
            slot.cache = cache

    def _prefill_due(self, waiting: list[Slot], running: list[Slot]) -> bool:
        """Whether the waiting prompts prefill now: nothing decodes, or the oldest has waited long enough."""
        oldest = min(slot.request.arrived for slot in waiting)
        return not running or (self.clock() - oldest) * 1e3 >= self.config.max_prefill_delay_ms

    def _prefill_batch(self, waiting: list[Slot]) -> list[Slot]:
        batch, tokens = [], 0
        for slot in waiting[: self.config.max_batch_size]:
            if batch and tokens + len(slot.seq.prompt_ids) > self.config.prefill_token_budget:
                break
            batch.append(slot)
            tokens += len(slot.seq.prompt_ids)
        return batch

    def _next_batch(self, running: list[Slot]) -> list[Slot]:
        """The next decode batch in turn; batches are regrouped when the running set changed."""
        by_id = {s.seq.seq_id: s for s in running}
        if sorted(by_id) != sorted(i for group in self._groups for i in group):
            paths = np.stack([self.paths.path(s.seq.seq_id) for s in running])  # [N, L * E]
            self._groups = [[running[row].seq.seq_id for row in group]
                            for group in self.scheduler.group(paths, self.config.max_batch_size)]
            self._turn = 0
        group = self._groups[self._turn % len(self._groups)]
        self._turn += 1
        return [by_id[i] for i in group]

    def _finish(self, slot: Slot, reason: str | None, emit: bool = True) -> None:
        """Frees the slot and its KV cache and ends the sequence's state in the policy."""
        for key in [k for k, held in self._held.items() if slot in held.slots]:
            self._release(key)
        self.slots.remove(slot)
        slot.cache = None
        self.engine.end_sequence(slot.seq.seq_id)
        if emit and reason is not None:
            self.on_delta(slot.request, TextDelta(0, "", True, reason), False)
