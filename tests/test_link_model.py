"""The modelled link: a backlog of admitted reads, demand first after what is under way, advanced one layer's
compute per layer named, a read leaving when done or when its expert leaves the tier (1 ms per read, layers
of 2 ms)."""

import pytest

from moestream.link_model import ModelledLink
from moestream.topology import ExpertKey


def model(tail_ms: float = 1.0) -> ModelledLink:
    return ModelledLink(bytes_per_ms=100.0, layer_ms=2.0, expert_bytes=100, num_layers=4, tail_ms=tail_ms)


def test_a_plans_reads_move_while_the_layer_computes_and_stay_until_done_or_dropped():
    link = model()
    assert (link.state(0).backlog_bytes, link.state(0).next_need_ms) == (0.0, 2.0)
    link.speculate([ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(2, 0)])
    link.demand(ExpertKey(1, 3))  # layer 1 begins 2 ms later: two reads done, the third not started
    state = link.state(1)
    assert state.backlog_bytes == 200.0  # the demand load, then the read not started: plans keep theirs
    assert state.next_need_ms == 2.0  # max(2 ms of compute, 1 ms to land + 1 ms after)
    link.drop(ExpertKey(2, 0))  # its expert left the tier
    assert link.state(1).backlog_bytes == 100.0


def test_a_demand_load_goes_behind_the_read_under_way_and_ahead_of_those_not_started():
    link = model(tail_ms=0.0)
    link.state(0)
    link.speculate([ExpertKey(2, 0), ExpertKey(2, 1), ExpertKey(2, 2)])
    link.need(ExpertKey(1, 0))  # layer 1 (2 ms later): two reads done
    link.speculate([ExpertKey(3, 0), ExpertKey(3, 1)])
    link.need(ExpertKey(2, 0))  # layer 2: (2, 2) and (3, 0) done; (3, 1) 1 ms...
    link.demand(ExpertKey(2, 3))
    state = link.state(2)
    assert state.backlog_bytes == 200.0  # the demand load ahead of (3, 1), which has not started
    assert state.busy_ms == pytest.approx(2.0)


def test_a_needed_read_not_started_becomes_demand():
    link = model(tail_ms=0.0)
    link.state(0)
    link.demand(ExpertKey(0, 1))
    link.demand(ExpertKey(0, 2))
    link.demand(ExpertKey(0, 3))  # 3 ms of demand: layer 0 ends at 3 ms
    link.speculate([ExpertKey(1, 0)])
    link.need(ExpertKey(1, 0))  # layer 1 at 3 ms: the read has not started, and layer 1 waits for it
    state = link.state(1)
    assert (state.backlog_bytes, state.next_need_ms) == (100.0, 2.0)


def test_layers_nobody_named_pass_at_one_layers_compute_each():
    link = model()
    link.state(0)
    link.speculate([ExpertKey(3, e) for e in range(4)])
    assert link.state(2).backlog_bytes == 0.0  # layers 0 and 1 computed: 4 ms moved all four
    link.speculate([ExpertKey(3, e) for e in range(8)])
    link.demand(ExpertKey(0, 0))  # layers 2 and 3: 4 ms moved four of the eight, then the next token's layer 0
    assert link.state(0).backlog_bytes == 500.0  # the demand load ahead of the four not started
