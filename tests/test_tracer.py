"""The tracer: it sums every lane, keeps spans only when asked, builds lazy labels only then; a window
clips and orders spans; busy time counts overlaps once."""

import threading

import pytest

from moestream.tracer import LaneTotal, Span, Tracer, busy_s, overlap_s, since


def test_a_window_clips_the_spans_that_overlap_it_in_order_of_start():
    tracer = Tracer(keep_spans=100)
    tracer.add("disk", "b", 2.0, 5.0)
    tracer.add("experts", "a", 0.5, 1.5)
    tracer.add("experts", "outside", 6.0, 7.0)
    tracer.add("wait", "ends at the start", 0.0, 1.0)
    assert tracer.window(1.0, 4.0) == [Span("experts", "a", 1.0, 1.5), Span("disk", "b", 2.0, 4.0)]


def test_the_tracer_keeps_the_last_spans():
    tracer = Tracer(keep_spans=2)
    for i in range(3):
        tracer.add("experts", str(i), i, i + 0.5)
    assert [s.label for s in tracer.window(0, 10)] == ["1", "2"]


def test_every_lane_is_summed_whether_spans_are_kept_or_not():
    for tracer in (Tracer(), Tracer(keep_spans=1)):
        tracer.add("wait", "", 1.0, 1.5)
        tracer.add("wait", "", 2.0, 2.25)
        tracer.add("disk", "", 0.0, 1.0)
        assert tracer.totals() == {"wait": LaneTotal(0.75, 2), "disk": LaneTotal(1.0, 1)}


def test_totals_between_two_copies():
    tracer = Tracer()
    tracer.add("wait", "", 0.0, 1.0)
    before = tracer.totals()
    tracer.add("wait", "", 1.0, 3.0)
    assert since(tracer.totals(), before, "wait") == LaneTotal(2.0, 1)
    assert since(tracer.totals(), before, "disk") == LaneTotal()


def test_a_lazy_label_is_built_only_when_spans_are_kept():
    built = []

    def label():
        built.append(1)
        return "made"

    Tracer().add("policy", label, 0.0, 1.0)
    assert built == []
    kept = Tracer(keep_spans=4)
    kept.add("policy", label, 0.0, 1.0)
    assert built == [1] and kept.window(0.0, 2.0)[0].label == "made"


def test_a_span_is_recorded_even_when_its_block_raises():
    tracer = Tracer()
    with pytest.raises(RuntimeError):
        with tracer.span("experts", "boom"):
            raise RuntimeError("boom")
    assert tracer.totals()["experts"].spans == 1
    assert tracer.totals()["experts"].seconds >= 0


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


def test_a_call_returns_its_result_and_is_recorded_even_when_it_raises():
    tracer = Tracer(keep_spans=4)
    assert tracer.call("policy", "double", lambda x: 2 * x, 21) == 42
    with pytest.raises(ZeroDivisionError):
        tracer.call("policy", "divide", lambda x: 1 / x, 0)
    assert [s.label for s in tracer.window(float("-inf"), float("inf"))] == ["double", "divide"]
    assert tracer.totals()["policy"].spans == 2


def test_spans_from_several_threads_all_count():
    tracer = Tracer()

    def record():
        for _ in range(5000):
            tracer.add("disk", "", 0.0, 0.5)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    record()
    for thread in threads:
        thread.join()
    assert tracer.totals() == {"disk": LaneTotal(12500.0, 25000)}
