"""Live figures of a serving engine, for the dashboard and `moestream top`: one plain JSON-ready dict.

`LiveStats` watches a running `EngineWorker` through public seams (an engine observer, a step listener, the store's
and the worker's figures). A layer's lookups are what the store's counters gained between its routing event and the
next. Per-layer hit rates are a ring of the last `history` iterations; the rest is cumulative. Hooks run on the engine
thread, `snapshot()` on any (one lock guards the ring). Knows no HTTP route and no policy.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from moestream.contracts import Observer
from moestream.serving.metrics import gained

PERCENTILES = (50, 90, 99)


@dataclass
class _Row:
    step: int
    hits: list[int]  # [L]
    lookups: list[int]  # [L]


class LiveStats(Observer):
    def __init__(self, worker, history: int = 120):
        self.worker, self.store = worker, worker.engine.store
        self.num_layers = self.store.topology.num_layers
        self._rows: deque[_Row] = deque(maxlen=history)  # closed iterations, oldest first
        self._row: _Row | None = None  # the iteration under way
        self._layer: int | None = None  # the layer routed last, whose lookups are not counted yet
        self._seen = self._counts()  # (hits, misses) when counted last
        self._tokens = 0
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Starts watching (before the worker's thread starts)."""
        self.worker.engine.add_observer(self)
        self.worker.step_listeners.append(self.end_step)

    def detach(self) -> None:
        """Stops watching (after the worker's thread stopped)."""
        self.worker.engine.remove_observer(self)
        self.worker.step_listeners.remove(self.end_step)

    def begin_iteration(self, ctx) -> None:
        self.end_step()
        with self._lock:
            self._tokens += ctx.num_tokens
            self._row = _Row(ctx.step, [0] * self.num_layers, [0] * self.num_layers)

    def observe(self, event) -> None:
        self._settle()
        self._layer = event.layer

    def end_step(self) -> None:
        """Counts the last layer's lookups and closes the iteration's row."""
        self._settle()
        with self._lock:
            if self._row is not None:
                self._rows.append(self._row)
            self._row = None

    def _settle(self) -> None:
        """Gives the lookups since the last count to the layer routed last."""
        now = self._counts()
        hits, misses = (gained(n, b) for n, b in zip(now, self._seen))
        self._seen = now
        with self._lock:
            if self._row is not None and self._layer is not None:
                self._row.hits[self._layer] += hits
                self._row.lookups[self._layer] += hits + misses
        self._layer = None

    def _counts(self) -> tuple[int, int]:
        stats = self.store.stats()
        return stats.hits, stats.misses

    def snapshot(self) -> dict:
        """Every figure as JSON-ready values (rates in [0, 1] or None when nothing was counted)."""
        stats = self.store.stats()
        with self._lock:
            rows, tokens = list(self._rows), self._tokens
        return {"layers": self.num_layers, "tokens": tokens, "heatmap": _heatmap(rows),
                "hit_rate": _ratio(stats.hits, stats.hits + stats.misses), "host_compute": self._host_compute(),
                "tiers": self._tiers(),
                "transfers": {"in_flight": len(self.store.in_flight()), "late": stats.late,
                              "cancelled": stats.cancelled},
                "prediction": _prediction(stats),
                "bytes_per_token": {tier: _ratio(n, tokens) for tier, n in sorted(stats.bytes_read.items())},
                "latency_s": {"ttft": self._percentiles("moestream_ttft_seconds"),
                              "tpot": self._percentiles("moestream_tpot_seconds")},
                "requests": {"running": self._gauge("moestream_running_sequences"),
                             "waiting": self._gauge("moestream_queue_depth")}}

    def _host_compute(self) -> dict:
        """The rule, the misses computed on the host and their share of all misses (None: no miss yet)."""
        metrics = self.worker.metrics
        return {"rule": self.worker.engine.config.host_compute, "experts": metrics.num_host_computed,
                "share": metrics.host_share()}

    def _tiers(self) -> dict:
        totals = {"device": self.store.device_slots, "host": self.store.host_slots}
        return {tier: {"used": len(self.store.resident(tier)), "total": total} for tier, total in totals.items()}

    def _gauge(self, name: str) -> int:
        return int(self.worker.metrics.registry.get_sample_value(name) or 0)

    def _percentiles(self, name: str) -> dict:
        buckets = _buckets(self.worker.metrics.registry, name)
        count = buckets[-1][1] if buckets else 0
        return {"count": int(count)} | {f"p{p}": _quantile(buckets, p / 100) for p in PERCENTILES}


def _heatmap(rows: list[_Row]) -> dict:
    """steps [S], hit_rate [S][L] (None where a layer looked nothing up), lookups [S][L]."""
    return {"steps": [r.step for r in rows], "lookups": [r.lookups for r in rows],
            "hit_rate": [[_ratio(h, n) for h, n in zip(r.hits, r.lookups)] for r in rows]}


def _prediction(stats) -> dict:
    """precision: prefetched experts later used / prefetched; recall: lookups served by a prefetched
    expert / all lookups."""
    used = stats.prefetch_hits
    return {"prefetched": stats.prefetched, "used": used, "wasted": stats.prefetch_wasted,
            "precision": _ratio(used, stats.prefetched), "recall": _ratio(used, stats.hits + stats.misses)}


def _buckets(registry, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram, by bound."""
    samples = [s for metric in registry.collect() if metric.name == name for s in metric.samples
               if s.name == f"{name}_bucket"]
    return sorted((float(s.labels["le"]), s.value) for s in samples)


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, as Prometheus' histogram_quantile computes it."""
    if not buckets or not buckets[-1][1]:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None
