"""BandwidthAwarePlanner and a read that would land after its layer needs it (issue 46, item 3): weighed by the
wait it still saves against a demand read started when its layer needs it (score x (need - start)), against
the delay it imposes on the next layer's likely demand loads, instead of dropped."""

import math

from moestream.policies.contracts import CacheView, LinkState, Prediction
from moestream.policies.planning import BandwidthAwarePlanner


# 1 ms per read (100 bytes at 100 bytes/ms); layer 1 (the next) needs its experts at 2 ms, a layer computes 2 ms
def _view(backlog_bytes: float) -> CacheView:
    link = LinkState(bytes_per_ms=100.0, layer_ms=2.0, expert_bytes=100, backlog_bytes=backlog_bytes,
                     next_need_ms=2.0)
    return CacheView(frozenset(), frozenset(), capacity=8, layer_now=0, num_layers=6, link=link)


def _keys(plan) -> list:
    return [tuple(r.key) for r in plan]


# layer 1 predicted by one expert: its expected misses are 1 (the score, plus the mass left out)
DEMAND_P = 1.0 - math.exp(-1.0)  # 0.632: the chance layer 1 has a demand load the late read delays


def test_a_late_read_that_still_saves_more_wait_than_it_delays_is_kept():
    planner = BandwidthAwarePlanner(0.5, 0.1)
    # 1.5 ms queued: the read runs 1.5..2.5 ms, 0.5 ms after layer 1 needs it. A demand read started at 2 ms
    # would land at 3 ms, so it saves 0.9 x 0.5 = 0.45 ms; it delays layer 1's demand loads 0.632 x 0.5 = 0.32
    assert 0.9 * 0.5 > DEMAND_P * 0.5
    assert _keys(planner.plan([Prediction(1, 1, 0.9)], _view(backlog_bytes=150.0))) == [(1, 1)]


def test_a_late_read_is_weighed_by_the_wait_it_still_saves_not_by_a_whole_read():
    planner = BandwidthAwarePlanner(0.5, 0.1)
    # score 0.6: a whole read saved (0.6) would beat the delay (0.32), but only 0.5 ms of it is (0.3 < 0.32)
    assert 0.6 * 1.0 > DEMAND_P * 0.5 > 0.6 * 0.5
    assert planner.plan([Prediction(1, 1, 0.6)], _view(backlog_bytes=150.0)) == []


def test_a_late_read_that_delays_more_than_it_saves_is_dropped():
    planner = BandwidthAwarePlanner(0.5, 0.1)
    # 1.9 ms queued: the read runs 1.9..2.9 ms; it saves 0.9 x 0.1 = 0.09 ms, and delays 0.632 x 0.9 = 0.57
    assert planner.plan([Prediction(1, 1, 0.9)], _view(backlog_bytes=190.0)) == []
    # a read for a later layer in the same place lands in time (layer 2 needs it at 4 ms): a whole read saved
    assert _keys(planner.plan([Prediction(1, 1, 0.9), Prediction(2, 3, 0.9)], _view(backlog_bytes=190.0))) \
        == [(2, 3)]
