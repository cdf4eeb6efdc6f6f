"""A request to generate and what it streams back: `Request`, `Admitted` (its first event once a batcher took it
in), `TextDelta` (each step's new text), `TextStream` (releases text only where final). No engine, HTTP or queue.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from moestream.serving.sampling import SamplingParams


@dataclass(frozen=True)
class Admitted:
    """A request's first event once the worker has taken it in (else the exception that refused it)."""


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text since the request's previous delta
    finished: bool
    finish_reason: str | None = None


@dataclass
class Request:
    """One sequence to generate; emit gets Admitted (or the refusal), then TextDeltas or its step's error."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Admitted | TextDelta | Exception], None]
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    num_tokens: int = 0
    stopped: threading.Event = field(default_factory=threading.Event)  # its sequence's sampler shares it

    def cancel(self) -> None:
        """Stops the request (from any thread): dropped if still queued, ended before its next step if running."""
        self.stopped.set()

    @property
    def cancelled(self) -> bool:
        return self.stopped.is_set()


class TextStream:
    """One sequence's text, released only where final (no partial character or possible stop string at its end)."""

    def __init__(self, stop: tuple[str, ...]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        if not finished and text[self.sent: end].endswith("\ufffd"):
            end = self.sent
        piece, self.sent = text[self.sent: end], max(self.sent, end)
        return piece
