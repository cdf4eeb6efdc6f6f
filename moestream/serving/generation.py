"""A request to generate and what it streams back: `Request` (a prompt, its sampling params and the
callable that receives its events), `Admitted` (its first event once a batcher took it in), `TextDelta`
(each step's new text) and `TextStream`, which releases text only where it is final (stop strings
held back until they can no longer begin one). It knows no engine, no HTTP and no queue.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from moestream.serving.sampling import SamplingParams, SequenceSampler


@dataclass(frozen=True)
class Admitted:
    """A request's first event once the worker has taken it into the batcher (a refused request's
    first event is the exception that refused it)."""


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text since the request's previous delta
    finished: bool
    finish_reason: str | None = None


@dataclass
class Request:
    """One sequence to generate. emit gets Admitted (or the refusal), then TextDelta records, or an
    exception if its step failed."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Admitted | TextDelta | Exception], None]
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    num_tokens: int = 0
    _sampler: SequenceSampler | None = None
    _cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Stops the request: dropped if still queued, ended before its next step if running."""
        with self._lock:
            self._cancelled = True
            if self._sampler is not None:
                self._sampler.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def attach(self, sampler: SequenceSampler) -> None:
        """The sampler of the request's sequence, which a cancellation ends."""
        with self._lock:
            self._sampler = sampler
            if self._cancelled:
                sampler.cancel()


class TextStream:
    """The text of one sequence as it grows, released only where it is final (no partial character
    and no possible beginning of a stop string at its end)."""

    def __init__(self, stop: tuple[str, ...]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        if not finished and text[self.sent: end].endswith("\ufffd"):
            end = self.sent
        piece, self.sent = text[self.sent: end], max(self.sent, end)
        return piece
