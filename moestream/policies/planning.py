"""The score planners: predicted experts by score discounted with distance; and the bandwidth-aware
one, which keeps of them only the reads the link can afford (`BandwidthAwarePlanner`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from moestream.contracts import PLANNERS, CacheView, LinkState, Prediction, PrefetchPlanner, TransferRequest
from moestream.topology import ExpertKey

Candidate = tuple[ExpertKey, float, float, int]  # key, priority, score, layers ahead
Priority = Callable[[float, int, int], Any]  # (score, layer, layers ahead) -> priority (larger goes first)


def ranked(predictions: Sequence[Prediction], view: CacheView, priority: Priority,
           min_score: float = 0.0) -> list[Candidate]:
    """Predicted experts above min_score, not resident or in flight, at their best priority, highest first
    (then by key), at most view.capacity."""
    best: dict[tuple, tuple] = {}
    resident, in_flight, layer_now, num_layers = view.resident, view.in_flight, view.layer_now, view.num_layers
    for layer, expert, score, tokens_ahead in predictions:
        key = (layer, expert)  # an ExpertKey only for the kept ones: a tuple hashes and compares as one
        if score <= min_score or key in resident or key in in_flight:
            continue
        ahead = max(1, layer - layer_now + tokens_ahead * num_layers)
        value = priority(score, layer, ahead)
        if key not in best or value > best[key][0]:
            best[key] = (value, score, ahead)
    items = sorted(sorted(best.items()), key=lambda item: item[1][0], reverse=True)[: view.capacity]
    return [(ExpertKey._make(key), value, score, ahead) for key, (value, score, ahead) in items]


@PLANNERS.register("score")
class ScorePlanner(PrefetchPlanner):
    """Requests predicted experts not resident: priority = scale x score / layers_ahead, at most `capacity`,
    none scoring at or below min_score; equal priorities go by key."""

    def __init__(self, min_score: float = 0.0, scale: float = 1.0):
        self.min_score, self.scale = min_score, scale

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        scale = self.scale
        best = ranked(predictions, view, lambda score, layer, ahead: scale * score / ahead, self.threshold(view))
        return [TransferRequest(key, priority) for key, priority, _, _ in best]

    def threshold(self, view: CacheView) -> float:
        """The score a prediction must exceed to be requested now."""
        return self.min_score


class IdleAwarePlanner(ScorePlanner):
    """Requests experts of probability > min_score, or > idle_score while nothing moves to the tier."""

    def __init__(self, min_score: float, idle_score: float):
        super().__init__(min_score)
        self.idle_score = idle_score

    def threshold(self, view: CacheView) -> float:
        return self.min_score if view.in_flight else self.idle_score


VictimWaits = Callable[[int, int], list[float]]  # (capacity, count) -> the waits of the next count victims


class BandwidthAwarePlanner(IdleAwarePlanner):
    """IdleAwarePlanner where the view has no link; with one (`CacheView.link`), every predicted expert by
    score / layers ahead, keeping only the reads the link can afford, in that order:

    - each read starts once the link's backlog and the reads kept before it are done; one that would start
      after the next layer needs its experts is left to the next plan;
    - if needed (probability: the score) it saves min(one read, need - start) of a demand read's wait;
    - one running past the next layer's start may delay that layer's demand loads (probability
      1 - exp(-expected misses); for a read of that layer, only where its own expert is not needed): it is
      kept only if what it saves exceeds that expected delay;
    - with `victim_waits` (the eviction's, in `wait(key)`'s units), one whose own expected wait is longer
      than its victim's is dropped: the victim would be read back before the prefetch is used.
    No threshold is tuned: the score is the predictor's probability, the rest are the link's figures.
    """

    def __init__(self, min_score: float, idle_score: float, wait: Callable[[ExpertKey], float] | None = None,
                 victim_waits: VictimWaits | None = None):
        super().__init__(min_score, idle_score)
        self.wait, self.victim_waits = wait, victim_waits

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        if view.link is None:
            return super().plan(predictions, view)
        candidates = ranked(predictions, view, lambda score, layer, ahead: score / ahead)
        return self.affordable(candidates, view.link, expected_misses(predictions, view), view.capacity)

    def affordable(self, candidates: list[Candidate], link: LinkState, misses: float,
                   capacity: int) -> list[TransferRequest]:
        """The candidates the link can afford (the class docstring), in order."""
        start, read_ms, next_ms = link.busy_ms, link.read_ms, link.next_need_ms
        victims = self.victim_waits(capacity, len(candidates)) if self.victim_waits and self.wait else None
        kept: list[TransferRequest] = []
        for key, priority, score, ahead in candidates:
            if start >= next_ms:
                break  # starts after the next plan replaces this one
            finish = start + read_ms
            saved_ms = min(read_ms, link.need_ms(ahead) - start)  # > 0: start < next_ms <= need_ms(ahead)
            if finish > next_ms and score * saved_ms <= holds_up(score, ahead, misses) * (finish - next_ms):
                continue  # saves less than it delays the next layer's demand loads
            if victims is not None and self.wait(key) >= victims[len(kept)]:
                continue  # its victim is expected back sooner than it is needed
            kept.append(TransferRequest(key, priority))
            start = finish
            misses -= score if ahead == 1 else 0.0
        return kept


def holds_up(score: float, ahead: int, misses: float) -> float:
    """The chance that a read running past the next layer's start holds up that layer's demand loads
    (misses: their expected number); for a read of that layer, only if its own expert is not needed."""
    if ahead == 1:
        return (1.0 - score) * (1.0 - math.exp(-max(0.0, misses - score)))
    return 1.0 - math.exp(-misses)


def expected_misses(predictions: Sequence[Prediction], view: CacheView) -> float:
    """Expected demand loads of the next layer: its predicted experts neither resident nor in flight, by
    probability, plus the probability mass its predictions leave out."""
    layer_now, num_layers = view.layer_now, view.num_layers
    missing = total = 0.0
    count = 0
    for layer, expert, score, tokens_ahead in predictions:
        if layer - layer_now + tokens_ahead * num_layers != 1:
            continue
        count += 1
        total += score
        if (layer, expert) not in view.resident and (layer, expert) not in view.in_flight:
            missing += score
    return missing + max(0.0, count - total)
