"""The scheduler: it admits sequences, owns them and their KV caches, and each step is
schedule -> (the engine's forward) -> postprocess. Every way of generating loops on `Engine.step`.

`Admission`: at most max_seqs sequences, their reserved KV bytes (prompt + max_tokens) within
kv_budget_bytes; a sequence without room queues in order, one that could never fit is refused
(`KvBudgetError`). The batching rule picks what runs: `StaticBatches` runs a batch to its last
sequence's end, finished ones staying as inactive rows (as `generate` does; the only rule for an
encoder-decoder); `ContinuousBatches` (continuous.py) lets sequences join and leave between steps.
`postprocess` is the one place tokens are chosen and sequences end: cancelled or a stop string (its
sampler), max_tokens ("length"), or an end-of-sequence token ("stop"). Knows no model, request or HTTP.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from moestream.budget import format_bytes
from moestream.errors import MoestreamError
from moestream.runtime import kv
from moestream.runtime.runner import BatchCache, Sequence
from moestream.runtime.scheduling.token_scheduler import RoutingPaths


class KvBudgetError(MoestreamError):
    """A sequence needs more KV cache than the whole budget."""


@dataclass(frozen=True)
class Admission:
    """Which sequences may run together; the defaults admit every sequence."""

    max_seqs: int = sys.maxsize  # sequences admitted and not ended
    kv_budget_bytes: int = sys.maxsize  # the KV bytes they may reserve
    bytes_per_token: int = 0  # KV bytes of one position (0: no KV budget)

    def __post_init__(self):
        if 2 * self.bytes_per_token > self.kv_budget_bytes:  # one prompt token and one new token
            raise KvBudgetError(f"the KV budget (--kv-budget) of {format_bytes(self.kv_budget_bytes)} holds no "
                                f"request: one prompt token and one new token take "
                                f"{format_bytes(2 * self.bytes_per_token)} "
                                f"({self.bytes_per_token} bytes of KV a token)")

    def need_bytes(self, positions: int) -> int:
        return positions * self.bytes_per_token

    def fits(self, positions: int) -> bool:
        return self.need_bytes(positions) <= self.kv_budget_bytes

    def check(self, positions: int) -> None:
        if not self.fits(positions):
            raise KvBudgetError(f"the request needs {self.need_bytes(positions)} bytes of KV cache, "
                                f"over the budget of {self.kv_budget_bytes}")


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's sequences (rows in order) and the cache they run over."""

    is_prefill: bool
    seqs: list[Sequence]
    cache: BatchCache


class BatchingRule(Protocol):
    """Which sequences run next, over which cache; it keeps the caches of the sequences it holds."""

    def schedule(self, waiting: list[Sequence], running: list[Sequence]) -> ScheduledBatch | None: ...

    def ran(self, batch: ScheduledBatch) -> None: ...  # after its forward pass: its cache holds its past

    def release(self, seq: Sequence) -> None:
        """Frees the ended sequence's cache."""

    def cached_lengths(self) -> dict[int, int]: ...  # each sequence's cached positions, over every cache held

    def cached_bytes(self) -> int: ...  # of every cache held


@dataclass
class StaticBatches:
    """A batch of up to max_batch_size waiting sequences runs from its prefill until all have ended."""

    max_batch_size: int
    batch: ScheduledBatch | None = None

    def schedule(self, waiting: list[Sequence], running: list[Sequence]) -> ScheduledBatch | None:
        if self.batch is not None and not all(s.finished for s in self.batch.seqs):
            self.batch = ScheduledBatch(False, self.batch.seqs, self.batch.cache)
        elif waiting:
            self.batch = ScheduledBatch(True, waiting[: self.max_batch_size], BatchCache())
        else:
            self.batch = None
        return self.batch

    def ran(self, batch: ScheduledBatch) -> None:
        pass  # the batch keeps its cache to its end

    def release(self, seq: Sequence) -> None:
        if self.batch is not None and all(s.finished for s in self.batch.seqs):
            self.batch = None  # its cache with it

    def cached_lengths(self) -> dict[int, int]:
        if self.batch is None or self.batch.cache.kv is None:
            return {}
        past = self.batch.cache.kv.get_seq_length()
        return {s.seq_id: past for s in self.batch.seqs if not s.finished}

    def cached_bytes(self) -> int:
        return 0 if self.batch is None or self.batch.cache.kv is None else kv.num_bytes(self.batch.cache.kv)


@dataclass
class Scheduler:
    """The sequences not yet ended, in arrival order (queued: not admitted; waiting: admitted, not
    prefilled; running: prefilled)."""

    rule: BatchingRule
    eos_ids: set[int]
    end_sequence: Callable[[int], None]  # ends a sequence's state in the policy and observers
    admission: Admission = field(default_factory=Admission)
    paths: RoutingPaths | None = None  # the routing paths the rule groups by (an engine observer), if any
    detach: Callable[[], None] = lambda: None  # stops what the scheduler observes (close)
    queued: list[tuple[Sequence, int]] = field(default_factory=list)  # with the positions each reserves
    waiting: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    reserved: dict[int, int] = field(default_factory=dict)  # KV bytes by admitted seq id
    in_flight: ScheduledBatch | None = None  # scheduled and not postprocessed (its step failed, if any)

    def add(self, seq: Sequence, positions: int | None = None) -> None:
        """Admits the sequence or queues it; positions: the KV positions it reserves (default: prompt + max_tokens)."""
        positions = seq_positions(seq) if positions is None else positions
        self.admission.check(positions)
        self.queued.append((seq, positions))
        self._admit_queued()

    def can_admit(self, positions: int) -> bool:
        """Room now for a sequence of that many positions (nothing queued ahead of it)."""
        return not self.queued and self._room_for(positions)

    @property
    def reserved_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def seqs(self) -> list[Sequence]:
        return self.running + self.waiting

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None: nothing to run); cancelled sequences end first."""
        for seq in [s for s in self._unended if s.sampler is not None and s.sampler.cancelled]:
            self.finish(seq, "abort")
        self._admit_queued()
        self.in_flight = self.rule.schedule(self.waiting, self.running)
        return self.in_flight

    def close(self) -> None:
        for seq in self._unended:
            self.finish(seq, "abort")
        self.detach()
        self.detach = lambda: None

    def postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int | None]:
        """Appends each row's token, ends finished sequences; each row's token (None: it had ended)."""
        self.rule.ran(batch)
        if batch.is_prefill:
            self.waiting = [s for s in self.waiting if s not in batch.seqs]
            self.running += [s for s in batch.seqs if not s.finished]
        tokens = []
        for row, seq in enumerate(batch.seqs):
            tokens.append(None if seq.finished else self._append(seq, logits[row]))
        self.in_flight = None
        return tokens

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.queued = [(s, n) for s, n in self.queued if s is not seq]
        self.waiting = [s for s in self.waiting if s is not seq]
        self.running = [s for s in self.running if s is not seq]
        self.reserved.pop(seq.seq_id, None)
        self.rule.release(seq)
        self.end_sequence(seq.seq_id)

    def cached_lengths(self) -> dict[int, int]:
        return self.rule.cached_lengths()

    def cached_bytes(self) -> int:
        return self.rule.cached_bytes()

    @property
    def _unended(self) -> list[Sequence]:
        return self.seqs + [seq for seq, _ in self.queued]

    def _room_for(self, positions: int) -> bool:
        return (len(self.seqs) < self.admission.max_seqs
                and self.reserved_bytes + self.admission.need_bytes(positions) <= self.admission.kv_budget_bytes)

    def _admit_queued(self) -> None:
        while self.queued and self._room_for(self.queued[0][1]):
            seq, positions = self.queued.pop(0)
            self.reserved[seq.seq_id] = self.admission.need_bytes(positions)
            self.waiting.append(seq)

    def _append(self, seq: Sequence, logits: torch.Tensor) -> int:
        """logits [V]: the token chosen and appended."""
        token = int(logits.argmax()) if seq.sampler is None else seq.sampler.choose(logits)
        seq.output_ids.append(token)
        reason = None if seq.sampler is None else seq.sampler.stop_reason(seq.output_ids)
        if reason is None and len(seq.output_ids) >= seq.max_tokens:
            reason = "length"
        if reason is None and token in self.eos_ids and not seq.ignore_eos:
            reason = "stop"
        if reason is not None:
            self.finish(seq, reason)
        return token


def seq_positions(seq: Sequence) -> int:
    return len(seq.prompt_ids) + seq.max_tokens


def eos_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
