"""Replays planned requests against a moestream (or any OpenAI-compatible) server on this machine and
measures each one as a client sees it: time to first token, time per output token, tokens, status.
The report gives throughput, percentiles, SLO attainment and a latency CDF plot. Bounded: requests
are sent only until the duration ends and unfinished ones are abandoned after a drain timeout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from moestream.atomic import atomic_path
from moestream.bench.tools.workload import PlannedRequest
from moestream.checks import check_loopback

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Measured:
    sent_s: float  # since the start of the run
    status: int  # HTTP status (0: no answer before the drain timeout or a connection error)
    ttft_s: float | None
    tpot_s: float | None  # mean time between tokens after the first (None with one token)
    latency_s: float | None
    num_tokens: int


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.2


async def _one(client: httpx.AsyncClient, request: PlannedRequest, start: float, model: str | None) -> Measured:
    await asyncio.sleep(max(0.0, start + request.send_at_s - time.perf_counter()))
    sent = time.perf_counter()
    body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0, "stream": True}
    stamps = []
    try:
        async with client.stream("POST", "/v1/completions", json=body | ({"model": model} if model else {})) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps.append(time.perf_counter())
            status = answer.status_code
    except httpx.HTTPError:
        status = 0
    return _measured(sent - start, status, sent, stamps)


def _measured(sent_s: float, status: int, sent: float, stamps: list[float]) -> Measured:
    if status != 200 or not stamps:  # a 200 without a token is a failure too
        return Measured(sent_s, 0 if status == 200 else status, None, None, None, 0)
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return Measured(sent_s, status, stamps[0] - sent, tpot, stamps[-1] - sent, len(stamps))


async def replay(url: str, requests: list[PlannedRequest], drain_timeout_s: float,
                 api_key: str | None = None, model: str | None = None) -> tuple[list[Measured], float]:
    """Sends every request at its time; returns their measurements and the run's wall time."""
    check_loopback(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(requests) + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=drain_timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, r, start, model)) for r in requests]
        last = max((r.send_at_s for r in requests), default=0.0)
        done, pending = await asyncio.wait(tasks, timeout=last + drain_timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - start
    measured = [t.result() for t in tasks if t in done]
    measured += [Measured(r.send_at_s, 0, None, None, None, 0) for r, t in zip(requests, tasks) if t in pending]
    return measured, wall


def report(measured: list[Measured], wall_s: float, slo: Slo) -> dict:
    """Throughput, TTFT and TPOT percentiles (ms) and the share of requests meeting the SLO."""
    ok = [m for m in measured if m.status == 200]
    ttft = np.array([m.ttft_s for m in ok]) * 1e3
    tpot = np.array([m.tpot_s for m in ok if m.tpot_s is not None]) * 1e3
    met = [m for m in ok if m.ttft_s <= slo.ttft_s and (m.tpot_s is None or m.tpot_s <= slo.tpot_s)]
    return {
        "num_requests": len(measured),
        "num_completed": len(ok),
        "num_failed": len(measured) - len(ok),
        "failures": _failures(measured),
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s else 0.0,
        "throughput_tokens_per_s": sum(m.num_tokens for m in ok) / wall_s if wall_s else 0.0,
        "ttft_ms": _percentiles(ttft),
        "tpot_ms": _percentiles(tpot),
        "slo": asdict(slo),
        "slo_attainment": len(met) / len(measured) if measured else 0.0,
    }


def _failures(measured: list[Measured]) -> dict[str, int]:
    """How many requests failed, by HTTP status ('no answer': refused, reset or past the drain timeout)."""
    labels = [str(m.status) if m.status else "no answer" for m in measured if m.status != 200]
    return {label: labels.count(label) for label in sorted(set(labels))}


def _percentiles(values: np.ndarray) -> dict[str, float | None]:
    return {f"p{p}": (float(np.percentile(values, p)) if values.size else None) for p in PERCENTILES}


def summary(figures: dict) -> str:
    def ms(key):
        return " ".join(f"{name} {value:.1f}" if value is not None else f"{name} n/a"
                        for name, value in figures[key].items())

    failed = ", ".join(f"{label} x{count}" for label, count in figures["failures"].items())
    return (f"{figures['num_completed']}/{figures['num_requests']} requests in {figures['wall_s']:.1f} s"
            f"{f' ({failed} failed)' if failed else ''}: "
            f"{figures['throughput_rps']:.2f} req/s, {figures['throughput_tokens_per_s']:.1f} tokens/s; "
            f"TTFT ms {ms('ttft_ms')}; TPOT ms {ms('tpot_ms')}; SLO attainment {100 * figures['slo_attainment']:.1f}%")


def plot_cdf(measured: list[Measured], path: Path, title: str) -> Path:
    """Empirical CDFs of TTFT and end-to-end latency (Agg backend, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label, values in (("TTFT", [m.ttft_s for m in measured if m.ttft_s is not None]),
                          ("end-to-end", [m.latency_s for m in measured if m.latency_s is not None])):
        values = np.sort(np.array(values) * 1e3)
        axes.step(values, np.arange(1, values.size + 1) / max(values.size, 1), where="post", label=label)
    axes.set(xlabel="latency (ms)", ylabel="fraction of requests", title=title)
    axes.legend()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
    return path

