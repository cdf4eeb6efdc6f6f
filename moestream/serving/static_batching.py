"""Serving for models whose runner keeps no per-sequence cache (encoder-decoder: Switch): static batches.

The requests taken in run together as one batch from their prompts to their ends (`run_batch`, the
offline `LLM` path), each row streaming its text as it is sampled; a request that arrives meanwhile
waits for the batch to finish, and one cancelled mid-way ends after the current step. It offers the
worker what `ContinuousBatcher` does (slots, admission, step, close), so the server, its errors and
its metrics are the same. There is no KV budget to respect: a batch's cache lives only while it runs.
It knows no HTTP and no queue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from moestream.serving.batching import BatchingConfig
from moestream.serving.generation import TextDelta, run_batch

if TYPE_CHECKING:
    from moestream.serving.worker import Request

log = logging.getLogger(__name__)


class StaticBatcher:
    def __init__(self, engine, config: BatchingConfig, on_delta: Callable[["Request", TextDelta, bool], None]):
        self.engine, self.config, self.on_delta = engine, config, on_delta
        self.slots: list[Request] = []  # the next batch, then the running one

    @property
    def reserved_bytes(self) -> int:
        return 0

    def can_admit(self, request: "Request") -> bool:
        return len(self.slots) < self.config.max_batch_size

    def fits(self, request: "Request") -> bool:
        return True

    def admit(self, request: "Request") -> None:
        self.slots.append(request)

    def step(self) -> bool:
        """Runs the admitted requests as one batch to their ends; False when there was none."""
        batch = list(self.slots)
        if not batch:
            return False
        try:
            run_batch(self.engine, [r.prompt_ids for r in batch], [r.params for r in batch],
                      on_delta=lambda d: self.on_delta(batch[d.row], TextDelta(0, d.text, d.finished, d.finish_reason), True),
                      on_sampler=lambda sampler: [r.attach(sampler, row) for row, r in enumerate(batch)])
        except Exception as error:  # the batch's clients get the error; the worker stays up
            log.exception("engine step failed")
            for request in batch:
                request.emit(error)
        finally:
            self.slots = []
        return True

    def close(self) -> None:
        """Ends the requests admitted but not run."""
        for request in self.slots:
            self.on_delta(request, TextDelta(0, "", True, "abort"), False)
        self.slots = []
