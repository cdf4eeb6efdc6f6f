"""ScorePlanner: non-resident predictions above a score floor, by scaled score / layers ahead; IdleAwarePlanner:
a lower floor while nothing moves to the tier; BandwidthAwarePlanner: only the reads the modelled link affords."""

from moestream.contracts import CacheView, LinkState, Prediction
from moestream.policies.planning import BandwidthAwarePlanner, IdleAwarePlanner, ScorePlanner
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


# BandwidthAwarePlanner: 1 ms per read (100 bytes at 100 bytes/ms), a layer computes 2 ms
def _link(backlog_bytes: float = 0.0, next_need_ms: float = 2.0, layer_ms: float = 2.0) -> LinkState:
    return LinkState(bytes_per_ms=100.0, layer_ms=layer_ms, expert_bytes=100, backlog_bytes=backlog_bytes,
                     next_need_ms=next_need_ms)


def _view(link: LinkState | None, layer_now: int = 0) -> CacheView:
    return CacheView(frozenset(), frozenset(), capacity=8, layer_now=layer_now, num_layers=6, link=link)


def _keys(plan) -> list:
    return [tuple(r.key) for r in plan]


def test_without_a_link_the_bandwidth_aware_planner_is_idle_aware():
    predictions = [Prediction(1, 1, 0.7), Prediction(2, 2, 0.3), Prediction(2, 4, 0.05)]
    planner, blind = BandwidthAwarePlanner(0.5, 0.1), IdleAwarePlanner(0.5, 0.1)
    assert planner.plan(predictions, _view(None)) == blind.plan(predictions, _view(None))


def test_a_read_that_would_start_after_the_next_layer_begins_is_left_to_the_next_plan():
    planner = BandwidthAwarePlanner(0.5, 0.1)
    predictions = [Prediction(3, 2, 0.9), Prediction(4, 0, 0.9)]
    assert planner.plan(predictions, _view(_link(backlog_bytes=200.0))) == []  # the link is busy until 2 ms


def test_speculation_never_delays_a_likely_demand_read_for_less_than_it_saves():
    """A read past the next layer's start delays that layer's demand loads: kept only if score x one read
    exceeds P(a demand load there) x the overrun."""
    link = _link(backlog_bytes=50.0)  # reads start at 0.5 ms; layer 1 needs its experts at 2 ms
    likely_miss = [Prediction(1, 1, 0.9), Prediction(1, 2, 0.1)]  # only (1, 1) lands by 2 ms
    planner = BandwidthAwarePlanner(0.5, 0.1)
    # (1, 2), ranked after (2, 3), would land 0.5 ms late: it saves 0.1 x 0.5 ms, delays 0.9 x 0.63 x 0.5: skipped
    # (2, 3) would run 1.5..2.5 ms, 0.5 ms into layer 1, which expects 1.1 misses: P = 1 - exp(-1.1) = 0.67
    assert _keys(planner.plan(likely_miss + [Prediction(2, 3, 0.3)], _view(link))) == [(1, 1)]  # saves 0.3 < 0.33
    assert _keys(planner.plan(likely_miss + [Prediction(2, 3, 0.6)], _view(link))) == [(1, 1), (2, 3)]  # 0.6 > 0.33
    resident = CacheView(frozenset({ExpertKey(1, 1), ExpertKey(1, 2)}), frozenset(), capacity=8, layer_now=0,
                         num_layers=6, link=link)
    surely_hit = [Prediction(1, 1, 1.0), Prediction(1, 2, 1.0), Prediction(2, 3, 0.3)]  # layer 1 has no miss
    assert _keys(planner.plan(surely_hit, resident)) == [(2, 3)]


def test_a_prefetch_expected_later_than_its_victim_is_dropped():
    waits = {(1, 1): 3.0, (2, 3): 9.0}
    planner = BandwidthAwarePlanner(0.5, 0.1, wait=lambda key: waits[tuple(key)],
                                    victim_waits=lambda capacity, count: [5.0] * count)
    predictions = [Prediction(1, 1, 0.9), Prediction(2, 3, 0.9)]
    assert _keys(planner.plan(predictions, _view(_link(layer_ms=4.0, next_need_ms=4.0)))) == [(1, 1)]
