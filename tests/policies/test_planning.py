"""ScorePlanner: non-resident predictions above a score floor, by scaled score / layers ahead; IdleAwarePlanner:
a lower floor while nothing moves to the tier."""

from moestream.policies.contracts import CacheView, Prediction
from moestream.policies.planning import IdleAwarePlanner, ScorePlanner
from moestream.topology import ExpertKey


def test_planner_requests_likely_experts_by_urgency():
    planner = ScorePlanner(min_score=0.4)
    predictions = [Prediction(3, 1, 0.9), Prediction(2, 2, 0.6), Prediction(2, 3, 0.3), Prediction(4, 0, 0.99)]
    view = CacheView(frozenset({ExpertKey(4, 0)}), frozenset(), capacity=8, layer_now=1, num_layers=5)
    plan = planner.plan(predictions, view)
    assert [r.key for r in plan] == [ExpertKey(2, 2), ExpertKey(3, 1)]  # 0.6/1 > 0.9/2; 0.3 below; (4,0) resident


def test_scale_and_ties_and_capacity():
    predictions = [Prediction(2, 5, 0.5), Prediction(2, 1, 0.5), Prediction(3, 0, 1.0), Prediction(2, 0, 0.0)]
    view = CacheView(frozenset(), frozenset({ExpertKey(3, 0)}), capacity=2, layer_now=1, num_layers=4)
    plan = ScorePlanner(scale=0.5).plan(predictions, view)
    assert [(r.key, r.priority) for r in plan] == [(ExpertKey(2, 1), 0.25), (ExpertKey(2, 5), 0.25)]


def test_the_planner_lowers_its_bar_while_nothing_moves_to_the_tier():
    planner = IdleAwarePlanner(min_score=0.5, idle_score=0.1)
    predictions = [Prediction(2, 1, 0.7), Prediction(3, 2, 0.3), Prediction(3, 4, 0.05)]
    idle = CacheView(frozenset(), frozenset(), capacity=4, layer_now=0, num_layers=5)
    busy = CacheView(frozenset(), frozenset({ExpertKey(1, 0)}), capacity=4, layer_now=0, num_layers=5)
    assert [r.key for r in planner.plan(predictions, idle)] == [ExpertKey(2, 1), ExpertKey(3, 2)]
    assert [r.key for r in planner.plan(predictions, busy)] == [ExpertKey(2, 1)]
