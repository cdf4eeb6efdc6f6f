"""The server's log lines: a periodic line over the period's work only, one line per finished request."""

import logging

from moestream.serving import logs
from moestream.serving.generation import Request
from moestream.serving.sampling import SamplingParams
from moestream.store.stats import StoreStats


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_periodic_line_gives_the_period_s_rates_and_nothing_when_idle(caplog):
    caplog.set_level(logging.INFO, "moestream.serve")
    clock = Clock()
    periodic = logs.Periodic(period_s=10, clock=clock)
    first = StoreStats(hits=10, misses=10, bytes_read={"disk": 1000, "host": 0})
    clock.now += 10
    periodic.maybe_log(0, 0, lambda: first)  # nothing ran: no line, but the period starts here
    assert caplog.text == ""
    periodic.tokens(30)
    clock.now += 5
    periodic.maybe_log(2, 1, lambda: 1 / 0)  # not due: the stats are not read
    clock.now += 5
    periodic.maybe_log(2, 1, lambda: StoreStats(hits=40, misses=20, bytes_read={"disk": 1000 + 10 * 2**20, "host": 0}))
    assert "2 running, 1 waiting; 3.0 tokens/s, expert hit rate 75.0%, disk 1.0 MiB/s" in caplog.text


def test_with_host_compute_the_periodic_line_gives_the_period_s_misses_computed_on_the_host(caplog):
    caplog.set_level(logging.INFO, "moestream.serve")
    clock = Clock()
    periodic = logs.Periodic(period_s=10, clock=clock, host_compute=True)
    periodic.tokens(10)
    periodic.host_computed(5)
    clock.now += 10
    periodic.maybe_log(1, 0, lambda: StoreStats(hits=10, misses=15, bytes_read={"disk": 0, "host": 0}))
    assert "expert hit rate 40.0%, disk 0 B/s, on host 25.0% of misses" in caplog.text  # 5 of 5 + 15
    caplog.clear()
    periodic.tokens(10)  # the next period: none on the host, nor missed
    clock.now += 10
    periodic.maybe_log(1, 0, lambda: StoreStats(hits=20, misses=15, bytes_read={"disk": 0, "host": 0}))
    assert "on host n/a of misses" in caplog.text
    caplog.clear()
    plain = logs.Periodic(period_s=10, clock=clock)  # off: the line says nothing of the host
    plain.tokens(1)
    clock.now += 10
    plain.maybe_log(1, 0, lambda: StoreStats(hits=1, misses=1, bytes_read={"disk": 0, "host": 0}))
    assert caplog.text and "on host" not in caplog.text


def test_a_finished_request_is_one_line(caplog):
    caplog.set_level(logging.INFO, "moestream.serve")
    request = Request([1, 2, 3], SamplingParams(max_tokens=4), lambda event: None)
    request.first_token, request.num_tokens = request.arrived + 0.05, 1
    logs.finished(7, request, "length")
    assert "request 7 finished (length): 3 prompt + 1 output tokens, TTFT 50.0 ms, TPOT n/a" in caplog.text


def test_the_shutdown_line_counts_requests_in_good_english(caplog):
    caplog.set_level(logging.INFO, "moestream.serve")
    for count, said in ((0, "0 requests"), (1, "1 request"), (2, "2 requests")):
        caplog.clear()
        logs.stopped(count)
        assert caplog.messages == [f"moestream: shut down after {said}"]
