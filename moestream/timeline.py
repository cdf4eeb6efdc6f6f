"""A timeline of what the engine's threads did, for finding where a token's time goes.

Spans (lane, label, begin, end; `time.perf_counter` seconds) are recorded by the mechanism when it is
given a timeline: the compute thread's routed expert MLPs ("experts"); the observers' begin and
observe calls (the policy's predictor and eviction state) and the policy's decisions after each gate
("policy"); its waits for expert bytes ("wait"); each transfer round on its link's worker ("disk",
"h2d": host to device). What the compute thread does between its spans is the dense part of the
model. Recording is thread-safe (a deque append) and bounded (the last `max_spans`). Knows no policy
and no store: it only keeps what it is told.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

LANES = ("experts", "policy", "wait", "disk", "h2d")  # h2d: the host -> device copy link


@dataclass(frozen=True)
class Span:
    lane: str
    label: str
    begin_s: float
    end_s: float


class Timeline:
    def __init__(self, max_spans: int = 200_000):
        self._spans: deque[Span] = deque(maxlen=max_spans)

    def add(self, lane: str, label: str, begin_s: float, end_s: float) -> None:
        self._spans.append(Span(lane, label, begin_s, end_s))

    def window(self, begin_s: float, end_s: float) -> list[Span]:
        """The spans that overlap [begin_s, end_s), clipped to it, in order of their start."""
        clipped = [Span(s.lane, s.label, max(s.begin_s, begin_s), min(s.end_s, end_s))
                   for s in list(self._spans) if s.end_s > begin_s and s.begin_s < end_s]
        return sorted(clipped, key=lambda s: s.begin_s)


def expert_names(keys) -> str:
    """A label of expert keys: layer/expert each."""
    return " ".join(f"{k.layer}/{k.expert}" for k in keys)


def busy_s(spans: list[Span]) -> float:
    """The time covered by at least one of the spans (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for span in sorted(spans, key=lambda s: s.begin_s):
        if span.end_s > reach:
            total += span.end_s - max(span.begin_s, reach)
            reach = span.end_s
    return total


def overlap_s(first: list[Span], second: list[Span]) -> float:
    """The time covered by both sets of spans."""
    return busy_s(first) + busy_s(second) - busy_s(first + second)
