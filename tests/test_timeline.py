"""The timeline's arithmetic: a window clips and orders spans; busy time counts overlaps once."""

import pytest

from moestream.timeline import Span, Timeline, busy_s, overlap_s


def test_a_window_clips_the_spans_that_overlap_it_in_order_of_start():
    timeline = Timeline()
    timeline.add("disk", "b", 2.0, 5.0)
    timeline.add("experts", "a", 0.5, 1.5)
    timeline.add("experts", "outside", 6.0, 7.0)
    timeline.add("wait", "ends at the start", 0.0, 1.0)
    assert timeline.window(1.0, 4.0) == [Span("experts", "a", 1.0, 1.5), Span("disk", "b", 2.0, 4.0)]


def test_the_timeline_keeps_the_last_spans():
    timeline = Timeline(max_spans=2)
    for i in range(3):
        timeline.add("experts", str(i), i, i + 0.5)
    assert [s.label for s in timeline.window(0, 10)] == ["1", "2"]


def test_busy_time_counts_overlaps_once():
    spans = [Span("disk", "", 0.0, 2.0), Span("disk", "", 1.0, 3.0), Span("disk", "", 2.5, 2.7),
             Span("disk", "", 4.0, 5.0)]
    assert busy_s(spans) == pytest.approx(4.0)
    assert busy_s([]) == 0.0


def test_overlap_is_the_time_both_cover():
    first = [Span("disk", "", 0.0, 2.0), Span("disk", "", 3.0, 4.0)]
    second = [Span("wait", "", 1.5, 3.5)]
    assert overlap_s(first, second) == pytest.approx(1.0)
    assert overlap_s(first, []) == 0.0
