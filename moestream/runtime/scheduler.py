"""The scheduler: it owns the sequences and their KV caches, and each step is schedule -> (the
engine's forward) -> postprocess.

`schedule` asks the batching rule which sequences run next and over which cache: `StaticBatches`
runs a batch from its prefill to its last sequence's end, finished sequences staying in it as
inactive rows (as transformers' `generate` does; the only rule for an encoder-decoder), and takes the
next batch only then; serving's continuous rule lets sequences join and leave between steps.
`postprocess` is the one place where tokens are chosen (argmax, or the sequence's sampler) and a
sequence ends: cancelled or a stop string (its sampler), max_tokens ("length"), or an end-of-sequence
token ("stop"). A sequence that ends leaves the rule, which frees its cache, and its state in the
policy is ended. The scheduler knows no model, no request and no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from moestream.runtime import kv
from moestream.runtime.runner import BatchCache, Sequence


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's sequences (rows in order) and the cache they run over."""

    is_prefill: bool
    seqs: list[Sequence]
    cache: BatchCache


class BatchingRule(Protocol):
    """Which sequences run next, over which cache; it keeps the caches of the sequences it holds."""

    def schedule(self, waiting: list[Sequence], running: list[Sequence]) -> ScheduledBatch | None: ...

    def ran(self, batch: ScheduledBatch) -> None:
        """After the batch's forward pass: its cache holds the batch's past."""

    def release(self, seq: Sequence) -> None:
        """Frees the ended sequence's cache (it is in no batch scheduled after this)."""

    def cached_lengths(self) -> dict[int, int]:
        """Each sequence's cached positions over every cache the rule holds."""

    def cached_bytes(self) -> int:
        """The bytes of every cache the rule holds."""


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
    """The sequences not yet ended, in arrival order (waiting: not prefilled; running: prefilled)."""

    rule: BatchingRule
    eos_ids: set[int]
    end_sequence: Callable[[int], None]  # ends a sequence's state in the policy and observers
    waiting: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    in_flight: ScheduledBatch | None = None  # scheduled and not postprocessed (its step failed, if any)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def seqs(self) -> list[Sequence]:
        return self.running + self.waiting

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (None: nothing to run); cancelled sequences end first."""
        for seq in [s for s in self.seqs if s.sampler is not None and s.sampler.cancelled]:
            self.finish(seq, "abort")
        self.in_flight = self.rule.schedule(self.waiting, self.running)
        return self.in_flight

    def postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int | None]:
        """Appends each row's token and ends the sequences that are done; returns each row's token
        (None: the row had ended before this step)."""
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
        """Ends the sequence: its cache is freed and its state in the policy ended."""
        seq.finish_reason = reason
        self.waiting = [s for s in self.waiting if s is not seq]
        self.running = [s for s in self.running if s is not seq]
        self.rule.release(seq)
        self.end_sequence(seq.seq_id)

    def cached_lengths(self) -> dict[int, int]:
        return self.rule.cached_lengths()

    def cached_bytes(self) -> int:
        return self.rule.cached_bytes()

    def _append(self, seq: Sequence, logits: torch.Tensor) -> int:
        """logits [V]: the token chosen, appended; the sequence ends if it is done."""
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


def eos_ids(generation_config) -> set[int]:
    """The token ids that end a sequence."""
    eos = generation_config.eos_token_id
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
