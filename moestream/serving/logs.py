"""The server's log lines, as vLLM prints them (start-up, each finished request, a periodic line while there is
work, shutdown), to the `moestream.serve` logger at INFO, which `moestream serve` shows. Decides nothing.
"""

from __future__ import annotations

import logging
import time

from moestream.budget import format_bytes

log = logging.getLogger("moestream.serve")
PERIOD_S = 10.0


def startup(engine) -> None:
    """Model, family, policy, each tier's budget in bytes and experts, device and threads."""
    config, topology, store = engine.config, engine.checkpoint.topology, engine.store
    log.info("moestream: %s (%s), %d MoE layers x %d experts (top-%d) of %s; policy %s; device %s, %s",
             engine.checkpoint.path, engine.checkpoint.adapter.model_type, topology.num_layers, topology.num_experts,
             topology.top_k, format_bytes(topology.expert_bytes), config.policy, config.device, engine.threads)
    for tier, slots in (("device", store.device_slots), ("host", store.host_slots)):
        log.info("moestream: %s tier: %d expert slots, %s (%.1f%% of the experts)", tier, slots,
                 format_bytes(slots * topology.expert_bytes), 100 * slots / topology.total_experts)
    if config.host_compute != "off":
        log.info("moestream: host compute %s: a device-tier miss held in the host tier may compute there, on %d "
                 "host thread%s", config.host_compute, config.host_threads, "" if config.host_threads == 1 else "s")


def finished(number: int, request, finish_reason: str) -> None:
    """One finished request: its tokens, TTFT, TPOT and why it ended."""
    ttft = (request.first_token - request.arrived) * 1e3 if request.first_token is not None else None
    tpot = ((time.perf_counter() - request.first_token) * 1e3 / (request.num_tokens - 1)
            if request.first_token is not None and request.num_tokens > 1 else None)
    log.info("moestream: request %d finished (%s): %d prompt + %d output tokens, TTFT %s, TPOT %s", number,
             finish_reason, len(request.prompt_ids), request.num_tokens, _ms(ttft), _ms(tpot))


def stopped(num_requests: int) -> None:
    log.info("moestream: shut down after %d request%s", num_requests, "" if num_requests == 1 else "s")


class Periodic:
    """Every PERIOD_S while requests run or wait: running and waiting requests, tokens/s, the expert hit rate,
    disk bytes/s and (with --host-compute) the share of misses computed on the host over the period."""

    def __init__(self, period_s: float = PERIOD_S, clock=time.perf_counter, host_compute: bool = False):
        self.period_s, self.clock, self.host_compute = period_s, clock, host_compute
        self._since, self._tokens, self._stats, self._on_host = clock(), 0, None, 0

    def tokens(self, count: int) -> None:
        self._tokens += count

    def host_computed(self, count: int) -> None:
        self._on_host += count

    def maybe_log(self, running: int, waiting: int, read_stats) -> None:
        """read_stats() -> the store's StoreStats, read only when a line is due."""
        now = self.clock()
        if now - self._since < self.period_s:
            return
        stats = read_stats()
        if running or waiting or self._tokens:
            before, seconds = self._stats, now - self._since
            hits = stats.hits - (before.hits if before else 0)
            misses = stats.misses - (before.misses if before else 0)
            disk = stats.bytes_read.get("disk", 0) - (before.bytes_read.get("disk", 0) if before else 0)
            rate = _percent(hits, hits + misses)
            on_host = (f", on host {_percent(self._on_host, self._on_host + misses)} of misses" if self.host_compute
                       else "")
            log.info("moestream: %d running, %d waiting; %.1f tokens/s, expert hit rate %s, disk %s/s%s",
                     running, waiting, self._tokens / seconds, rate, format_bytes(int(disk / seconds)), on_host)
        self._since, self._tokens, self._stats, self._on_host = now, 0, stats.copy(), 0


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"
