"""The score planners: predicted experts by score discounted with distance."""

from __future__ import annotations

from typing import Sequence

from moestream.policies.contracts import PLANNERS, CacheView, Prediction, PrefetchPlanner, TransferRequest
from moestream.topology import ExpertKey


def layers_ahead(prediction: Prediction, layer_now: int, num_layers: int) -> int:
    return prediction.layer - layer_now + prediction.tokens_ahead * num_layers


def _by_priority(item: tuple) -> tuple:
    return -item[1], item[0]  # highest first, then by key


@PLANNERS.register("score")
class ScorePlanner(PrefetchPlanner):
    """Requests predicted experts that are not resident, by score discounted with distance.

    priority = scale x score / layers_ahead; at most `capacity` requests, none with a score at or
    below min_score; equal priorities go by key.
    """

    def __init__(self, min_score: float = 0.0, scale: float = 1.0):
        self.min_score, self.scale = min_score, scale

    def plan(self, predictions: Sequence[Prediction], view: CacheView) -> list[TransferRequest]:
        best: dict = {}
        min_score, resident, in_flight = self.threshold(view), view.resident, view.in_flight
        layer_now, num_layers, scale = view.layer_now, view.num_layers, self.scale
        for layer, expert, score, tokens_ahead in predictions:
            if score <= min_score:
                continue
            key = (layer, expert)  # an ExpertKey only for the requests: a tuple hashes and compares as one
            if key in resident or key in in_flight:
                continue
            priority = scale * score / max(1, layer - layer_now + tokens_ahead * num_layers)  # layers_ahead, inlined
            best[key] = max(priority, best.get(key, 0.0))
        ranked = sorted(best.items(), key=_by_priority)[: view.capacity]
        return [TransferRequest(ExpertKey._make(key), priority) for key, priority in ranked]

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
