"""Serving's batcher: requests in, text deltas out, over the engine's step loop (docs/design.md,
Scheduling).

`admit` adds a request's sequence (with its own sampler) to the engine's scheduler while at most
max_num_seqs run and their reserved KV bytes (prompt + max_tokens each) stay within kv_budget_bytes;
each `step` is one `Engine.step`, after which each request gets its new text. Continuous batching where
the runner keeps per-sequence caches, else static batches (no KV budget). No HTTP and no queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from moestream.budget import format_bytes
from moestream.config import BatchingConfig
from moestream.errors import MoestreamError
from moestream.runtime.runner import Sequence
from moestream.runtime.scheduler import ScheduledBatch, StaticBatches
from moestream.serving.continuous import ContinuousBatches
from moestream.serving.generation import Request, TextDelta, TextStream
from moestream.serving.sampling import SequenceSampler
from moestream.serving.token_scheduler import TOKEN_SCHEDULERS, RoutingPaths

log = logging.getLogger(__name__)


class KvBudgetError(MoestreamError):
    """A request needs more KV cache than the whole budget."""


@dataclass(eq=False)
class Generating:
    """An admitted request: its engine sequence, text stream and reserved KV bytes."""

    request: Request
    seq: Sequence
    stream: TextStream
    reserved_bytes: int = 0


class Batcher:
    def __init__(self, engine, config: BatchingConfig, on_delta: Callable[[Request, TextDelta, bool], None],
                 clock: Callable[[], float] = time.perf_counter):
        """on_delta(request, delta, with a new token); clock: that of Request.arrived."""
        self.engine, self.config, self.on_delta = engine, config, on_delta
        self.requests: list[Generating] = []  # admitted and not ended, in arrival order
        continuous = engine.per_sequence_cache
        # each sequence's routing path, for the token scheduler (continuous batching only)
        self.paths = RoutingPaths(engine.checkpoint.topology) if continuous else None
        self.bytes_per_token = engine.kv_bytes_per_token() if continuous else 0  # 0: no KV budget
        _check_kv_budget(config.kv_budget_bytes, self.bytes_per_token)
        rule = self._continuous(clock) if continuous else StaticBatches(config.max_batch_size)
        self.scheduler = engine.scheduler(rule)
        if self.paths is not None:
            engine.add_observer(self.paths)
        self._observing = self.paths is not None
        tokenizer = engine.tokenizer
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    def _continuous(self, clock: Callable[[], float]) -> ContinuousBatches:
        config = self.config
        return ContinuousBatches(config.max_batch_size, config.prefill_token_budget, config.max_prefill_delay_ms,
                                 TOKEN_SCHEDULERS.create(config.token_scheduler), self.paths,
                                 self.engine.config.device, clock)

    # -- admission -------------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        return sum(g.reserved_bytes for g in self.requests)

    def need_bytes(self, request: Request) -> int:
        return (len(request.prompt_ids) + request.params.max_tokens) * self.bytes_per_token

    def can_admit(self, request: Request) -> bool:
        """Room for the request: fewer than max_num_seqs running and its KV bytes within the budget."""
        if len(self.requests) >= self.config.num_seqs:
            return False
        return self.reserved_bytes + self.need_bytes(request) <= self.config.kv_budget_bytes

    def fits(self, request: Request) -> bool:
        """Whether the request fits the KV budget at all (alone)."""
        return self.need_bytes(request) <= self.config.kv_budget_bytes

    def admit(self, request: Request) -> Sequence:
        """Adds the request's sequence to the scheduler; returns it."""
        need = self.need_bytes(request)
        if not self.fits(request):
            raise KvBudgetError(f"the request needs {need} bytes of KV cache, over the budget of "
                                f"{self.config.kv_budget_bytes}")
        sampler = SequenceSampler(request.params, self.decode, request.stopped)
        seq = self.engine.new_sequence(request.prompt_ids, request.params.max_tokens, sampler, request.params.ignore_eos)
        seq.arrived = request.arrived
        self.requests.append(Generating(request, seq, TextStream(request.params.stop), need))
        self.scheduler.add(seq)
        return seq

    def cached_lengths(self) -> dict[int, int]:
        """Each sequence's cached positions over every KV cache held: an ended sequence is in none."""
        return self.scheduler.cached_lengths()

    def cached_bytes(self) -> int:
        """The bytes of every KV cache held."""
        return self.scheduler.cached_bytes()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> ScheduledBatch | None:
        """One engine step and its requests' new text; returns the batch it ran (None: nothing to run).
        If the step fails, its requests get the error and end; the batcher stays up."""
        try:
            out = self.engine.step(self.scheduler)
        except Exception as error:  # the step's clients get the error; the batcher stays up
            log.exception("engine step failed")
            return self._fail(self.scheduler.in_flight, error)
        tokens = {} if out is None else {seq: token for seq, token in zip(out.batch.seqs, out.tokens)}
        for generating in list(self.requests):
            self._deliver(generating, tokens.get(generating.seq))
        return None if out is None else out.batch

    def close(self) -> None:
        """Aborts every admitted request and stops observing the engine."""
        for generating in list(self.requests):
            self.scheduler.finish(generating.seq, "abort")
            self._deliver(generating, None)
        if self._observing:
            self.engine.remove_observer(self.paths)
            self._observing = False

    def _deliver(self, generating: Generating, token: int | None) -> None:
        """Hands the request its new text after a token, or its end without one (e.g. cancelled)."""
        seq = generating.seq
        if seq.finished:
            self.requests.remove(generating)
        if token is not None:
            text = seq.sampler.text(seq.output_ids)
            delta = TextDelta(generating.stream.delta(text, seq.finished), seq.finished, seq.finish_reason)
            self.on_delta(generating.request, delta, True)
        elif seq.finished:
            self.on_delta(generating.request, TextDelta("", True, seq.finish_reason), False)

    def _fail(self, batch: ScheduledBatch | None, error: Exception) -> ScheduledBatch | None:
        """Ends the failed step's requests with the error (none if it failed before a batch was chosen)."""
        for generating in [g for g in self.requests if batch is not None and g.seq in batch.seqs]:
            self.requests.remove(generating)
            if not generating.seq.finished:
                self.scheduler.finish(generating.seq, "abort")
            generating.request.emit(error)
        return batch


def _check_kv_budget(budget_bytes: int, bytes_per_token: int) -> None:
    """Refuses a KV budget that no request fits: one prompt token and one new token."""
    if 2 * bytes_per_token > budget_bytes:
        raise KvBudgetError(f"the KV budget (--kv-budget) of {format_bytes(budget_bytes)} holds no request: "
                            f"one prompt token and one new token take {format_bytes(2 * bytes_per_token)} "
                            f"({bytes_per_token} bytes of KV a token)")
