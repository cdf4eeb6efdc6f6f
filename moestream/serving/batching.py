"""Serving's batcher: requests in, text deltas out, over the engine's scheduler and step loop (docs/design.md,
Scheduling). `admit` adds a request's sequence (with its sampler) to the BatchingConfig's scheduler (`open_scheduler`,
as `LLM`'s); each `step` is one `Engine.step`, after which each request gets its new text. No HTTP and no queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from moestream.config import BatchingConfig
from moestream.runtime.runner import Sequence
from moestream.runtime.scheduling.continuous import open_scheduler
from moestream.runtime.scheduling.scheduler import ScheduledBatch
from moestream.serving.generation import Request, TextDelta, TextStream
from moestream.serving.sampling import SequenceSampler

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Generating:
    """An admitted request: its engine sequence and text stream."""

    request: Request
    seq: Sequence
    stream: TextStream


class Batcher:
    def __init__(self, engine, config: BatchingConfig, on_delta: Callable[[Request, TextDelta, bool], None],
                 clock: Callable[[], float] = time.perf_counter):
        """on_delta(request, delta, with a new token); clock: that of Request.arrived."""
        self.engine, self.config, self.on_delta = engine, config, on_delta
        self.requests: list[Generating] = []  # admitted and not ended, in arrival order
        self.scheduler = open_scheduler(engine, config, clock)
        self.paths = self.scheduler.paths  # each sequence's routing path (continuous batching only)
        tokenizer = engine.tokenizer
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    def can_admit(self, request: Request) -> bool:
        """Room for the request now (the scheduler's max_num_seqs and KV budget)."""
        return self.scheduler.can_admit(_positions(request))

    def fits(self, request: Request) -> bool:
        """Whether the request fits the KV budget at all (alone)."""
        return self.scheduler.admission.fits(_positions(request))

    def admit(self, request: Request) -> Sequence:
        """Adds the request's sequence to the scheduler; returns it. Raises KvBudgetError if it cannot fit."""
        self.scheduler.admission.check(_positions(request))
        sampler = SequenceSampler(request.params, self.decode, request.stopped)
        params = request.params
        seq = self.engine.new_sequence(request.prompt_ids, params.max_tokens, sampler, params.ignore_eos)
        seq.arrived = request.arrived
        self.scheduler.add(seq, _positions(request))
        self.requests.append(Generating(request, seq, TextStream(request.params.stop)))
        return seq

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
        self.scheduler.close()

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


def _positions(request: Request) -> int:
    """The KV positions a request reserves: its prompt and max_tokens."""
    return len(request.prompt_ids) + request.params.max_tokens
