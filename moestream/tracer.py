"""The one optional tracer: the engine's parts report spans (lane, label, begin, end; `time.perf_counter` seconds)
through `span()`, `call()` or `add()`; it sums each lane (`totals()`) and keeps the spans only when asked
(`keep_spans`), for a timeline (labels may be callables, built only then). Thread-safe: each thread sums into its
own totals, without a lock. Knows no policy, store or model."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

# experts: routed expert MLPs; layer: a layer's other expert work; policy: observers and decisions; wait: for
# expert bytes; dense: dense modules (only `bench timeline` records them); disk, h2d: a round of reads, of copies
LANES = ("experts", "layer", "policy", "wait", "dense", "disk", "h2d")

Label = str | Callable[[], str]
_clock = time.perf_counter  # bound once: a span's own cost inside its measured time stays small


@dataclass(frozen=True)
class Span:
    lane: str
    label: str
    begin_s: float
    end_s: float


@dataclass(frozen=True)
class LaneTotal:
    seconds: float = 0.0
    spans: int = 0

    def __sub__(self, other: "LaneTotal") -> "LaneTotal":
        return LaneTotal(self.seconds - other.seconds, self.spans - other.spans)


class Tracer:
    def __init__(self, keep_spans: int = 0):
        """keep_spans: how many of the latest spans to keep for `window` (0: none, totals only)."""
        self._spans: deque[Span] | None = deque(maxlen=keep_spans) if keep_spans else None
        self._local = threading.local()  # .totals: this thread's lane -> (seconds, spans), written by it alone
        self._threads: list[dict[str, tuple[float, int]]] = []  # every thread's totals
        self._lock = threading.Lock()

    def span(self, lane: str, label: Label = "") -> "_Timed":
        """A context manager that records the time its with-block takes (also when it raises)."""
        return _Timed(self, lane, label)

    def call(self, lane: str, label: Label, function: Callable, argument):
        """function(argument), timed as a span; cheaper than `span` (e.g. for a cache's hooks)."""
        began = _clock()
        try:
            return function(argument)
        finally:
            self.add(lane, label, began, _clock())

    def add(self, lane: str, label: Label, begin_s: float, end_s: float) -> float:
        """Records a span that has ended; returns its seconds."""
        seconds = end_s - begin_s
        totals = self._thread_totals()
        before = totals.get(lane)
        totals[lane] = (seconds, 1) if before is None else (before[0] + seconds, before[1] + 1)  # one atomic store
        if self._spans is not None:
            span = Span(lane, label() if callable(label) else label, begin_s, end_s)
            with self._lock:
                self._spans.append(span)
        return seconds

    def totals(self) -> dict[str, LaneTotal]:
        """Each lane's seconds and spans since the tracer was made (subtract an earlier copy for a window)."""
        summed: dict[str, LaneTotal] = {}
        with self._lock:
            threads = [list(totals.items()) for totals in self._threads]
        for lane, (seconds, spans) in (item for items in threads for item in items):
            before = summed.get(lane, LaneTotal())
            summed[lane] = LaneTotal(before.seconds + seconds, before.spans + spans)
        return summed

    def _thread_totals(self) -> dict[str, tuple[float, int]]:
        """The calling thread's totals (no lock on the way: each thread writes its own)."""
        totals = getattr(self._local, "totals", None)
        if totals is None:
            totals = self._local.totals = {}
            with self._lock:
                self._threads.append(totals)
        return totals

    def window(self, begin_s: float, end_s: float) -> list[Span]:
        """The kept spans that overlap [begin_s, end_s), clipped to it, in order of their start."""
        with self._lock:
            spans = list(self._spans or ())
        clipped = [Span(s.lane, s.label, max(s.begin_s, begin_s), min(s.end_s, end_s))
                   for s in spans if s.end_s > begin_s and s.begin_s < end_s]
        return sorted(clipped, key=lambda s: s.begin_s)


class _Timed:
    """One span being timed (a class rather than a generator: the clock is read right around the block)."""

    __slots__ = ("_tracer", "_lane", "_label", "_began")

    def __init__(self, tracer: Tracer, lane: str, label: Label):
        self._tracer, self._lane, self._label = tracer, lane, label

    def __enter__(self) -> None:
        self._began = _clock()

    def __exit__(self, kind, error, trace) -> None:
        self._tracer.add(self._lane, self._label, self._began, _clock())


def since(now: dict[str, LaneTotal], before: dict[str, LaneTotal], lane: str) -> LaneTotal:
    """A lane's totals between two `Tracer.totals()` copies."""
    return now.get(lane, LaneTotal()) - before.get(lane, LaneTotal())


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
