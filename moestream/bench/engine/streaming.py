"""`moestream bench engine --streaming`: instead of the policies' runs, the disk while our engine streams
experts from it cold, beside sequential reads of the same disk.

Per budget, the demo prompts generated one at a time by a fresh cold engine (on-demand reads in decode);
and a cold serving prefill (the prompts as one, at the first budget and, informational, at the least budget
the store accepts), each paired with the sequential reference read around it. Before each run, one cold
sample of each way of reading (bench/tools/bandwidth.py), the layer pass among them. Targets (ok/missed,
never asserted): the serving prefill and the layer pass stream >= 80% of sequential bandwidth. For stable
figures on a busy machine: fixed torch threads, a fresh cold engine per run, medians over --repeats, TPOT
also in process CPU time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from moestream.budget import Budget, format_bytes
from moestream.config import EngineConfig
from moestream.report import fmt, report_console, rich_table

STREAM_TARGET = 0.80  # streaming bandwidth / sequential bandwidth, at least
REPORT_WIDTH = 120  # columns of the report when printing to a file or pipe
PREFILL_COPIES = 4  # the prompts, repeated this often, make the serving prefill's prompt


def measure_streaming(args, model: Path, budgets: list[str]) -> dict:
    """The mode's document: a row per budget, the prefills' rows and the disk's figures."""
    from moestream.checkpoint.demo import PROMPTS
    from moestream.threads import torch_threads

    with torch_threads(args.threads):
        rows, disk, prefills = compare_streaming(model, PROMPTS[: args.prompts], budgets, args)
    return {"model": str(model), "device": args.device, "repeats": args.repeats, "threads": args.threads,
            "runs": rows, **summarize(rows, disk, prefills)}


def _median(values) -> float:
    return statistics.median(values) if (values := list(values)) else 0.0


# -- one generation, and the runs -------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One prompt's generation."""

    ttft_ms: float
    tpot_ms: float
    cpu_tpot_ms: float  # process CPU time per decode step
    hits: int = 0
    misses: int = 0
    disk_bytes: int = 0
    host_bytes: int = 0
    disk_read_s: float = 0.0
    disk_batches: int = 0
    prompt_tokens: int = 0


class EngineModel:
    """Our engine, one prompt per generation, with a CPU clock among its observers."""

    def __init__(self, engine):
        from moestream.bench.engine.runners import CpuClock

        self.engine = engine
        self.cpu = CpuClock()
        engine.add_observer(self.cpu)

    def generate(self, prompt: str, max_new_tokens: int) -> Sample:
        self.cpu.marks.clear()
        metrics = self.engine.generate([prompt], max_new_tokens).metrics
        stats = self.engine.store.stats()
        return Sample(metrics.ttft_ms, metrics.tpot_ms, self.cpu.tpot_ms(), metrics.expert_hits,
                      metrics.expert_misses, metrics.bytes_read["disk"], metrics.bytes_read["host"],
                      stats.disk_read_s, stats.disk_batches, metrics.num_prompt_tokens)


def compare_streaming(model_dir: Path, prompts, budgets: list[str], args) -> tuple[list[dict], object, list[dict]]:
    """Each repetition: cold serving prefills (at the first budget, at the least), then cold runs per
    budget, a disk sample before each: (rows of the budgets, the ColdReadLog, the prefills' rows)."""
    from moestream.bench.tools.bandwidth import ColdReadLog
    from moestream.checkpoint.index import build_index

    index = build_index(model_dir).experts
    shards = sorted(model_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
    topology = index.topology
    least = f"{topology.top_k * topology.expert_bytes}B"  # bytes: the least budget the store accepts
    long_prompt = [" ".join(prompts * PREFILL_COPIES)]
    jobs = [(budgets[0], long_prompt, 1), (least, long_prompt, 1),  # max_new_tokens=1: the prefill alone
            *((budget, prompts, args.max_new_tokens) for budget in budgets)]
    runs: list[list[Sample]] = [[] for _ in jobs]
    disk = ColdReadLog()
    for repeat in range(args.repeats):
        for i, job in enumerate(jobs):
            turn = repeat * len(jobs) + i
            disk.take(shards[turn % len(shards)], index, turn, args.direct_io)
            runs[i] += cold_run(model_dir, *job, args)
    rows = [_engine_row(f"offload {b}", samples, len(prompts), b) for b, samples in zip(budgets, runs[2:])]
    prefills = [serving_prefill(runs[i], [disk.reference_around(r * len(jobs) + i) for r in range(args.repeats)],
                                jobs[i][0], topology) for i in (0, 1)]
    return rows, disk, prefills


def cold_run(model_dir: Path, budget: str, prompts, max_new_tokens: int, args) -> list[Sample]:
    """A fresh engine (empty device tier, files out of the page cache) generating for each prompt in turn."""
    from moestream.bench.tools.bandwidth import drop_page_cache
    from moestream.runtime import Engine

    with Engine(model_dir, EngineConfig(device=args.device, expert_budget=budget, direct_io=args.direct_io,
                                        num_threads=args.threads)) as engine:
        drop_page_cache(model_dir.glob("*.safetensors"))  # loading the dense part may have cached expert bytes
        ours = EngineModel(engine)
        return [ours.generate(prompt, max_new_tokens) for prompt in prompts]


# -- figures ---------------------------------------------------------------------------------------


def _latency_row(label: str, runs: list[Sample]) -> dict:
    medians = {key: _median(getattr(s, key) for s in runs) for key in ("ttft_ms", "tpot_ms", "cpu_tpot_ms")}
    return {"run": label, **medians, "num_samples": len(runs)}


def _engine_row(label: str, runs: list[Sample], per_repeat: int, budget: str) -> dict:
    """Latency medians; expert counts of one repetition (each repetition routes the same tokens from
    the same state); streaming bandwidth: the median over repetitions."""
    repeats = [runs[i : i + per_repeat] for i in range(0, len(runs), per_repeat)]
    hits, misses, batches, disk, host = (sum(getattr(s, key) for s in repeats[0])
                                         for key in ("hits", "misses", "disk_batches", "disk_bytes", "host_bytes"))
    return _latency_row(label, runs) | {
        "expert_budget": budget,
        "expert_hits": hits,
        "expert_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "bytes_read": {"disk": disk, "host": host},
        "stream_bytes_per_s": _median(_stream_rate(r) for r in repeats) if misses else None,
        "experts_per_read_batch": misses / batches if batches else None,
    }


def _stream_rate(runs: list[Sample]) -> float:
    seconds = sum(s.disk_read_s for s in runs)
    return sum(s.disk_bytes for s in runs) / seconds if seconds else 0.0


def serving_prefill(runs: list[Sample], around: list[float], budget: str, topology) -> dict:
    """The cold serving prefills' row, each one's rate paired with the sequential reference around it."""
    rates = [_stream_rate([s]) for s in runs]
    parsed = Budget.parse(budget)
    slots = parsed.resolve(topology.total_experts * topology.expert_bytes) // topology.expert_bytes
    return _engine_row(f"prefill {parsed}", runs, 1, budget) | {
        "device_slots": slots,
        "num_prompt_tokens": runs[0].prompt_tokens,
        "experts_routed_fraction": runs[0].misses / topology.total_experts,  # each routed expert misses once
        "wall_bytes_per_s": _median(s.disk_bytes * 1e3 / s.ttft_ms for s in runs if s.ttft_ms),
        "stream_samples_bytes_per_s": rates,
        "sequential_around_bytes_per_s": around,
        "vs_sequential": _median(rate / ref for rate, ref in zip(rates, around) if ref) or None,
    }


def summarize(rows: list[dict], disk, prefills: list[dict]) -> dict:
    medians, reference = disk.medians(), disk.reference()
    prefill, least = prefills
    stream = _median(r["stream_bytes_per_s"] for r in rows if r.get("stream_bytes_per_s")) or None
    prefill_ratio = prefill["vs_sequential"]
    layer_ratio = medians["layer_pass"] / reference if reference else None
    return {
        "sequential_read_bytes_per_s": reference,
        "disk_medians_bytes_per_s": medians,
        "disk_samples_bytes_per_s": disk.rates,
        "serving_prefill": prefill,
        "serving_prefill_vs_sequential": prefill_ratio,
        "least_budget_prefill": least,
        "least_budget_prefill_vs_sequential": least["vs_sequential"],
        "on_demand_bytes_per_s": stream,
        "on_demand_vs_sequential": stream / reference if stream and reference else None,
        "random_experts_vs_sequential": medians["random_experts"] / reference if reference else None,
        "layer_pass_vs_sequential": layer_ratio,
        "targets": {
            "serving_prefill_vs_sequential": _verdict(prefill_ratio, lambda r: r >= STREAM_TARGET),
            "layer_pass_vs_sequential": _verdict(layer_ratio, lambda r: r >= STREAM_TARGET),
        },
    }


def _verdict(ratio: float | None, meets) -> str:
    return "not measured" if ratio is None else "ok" if meets(ratio) else "missed"


def _rate(bytes_per_s) -> str:
    return "-" if not bytes_per_s else f"{bytes_per_s / 1e9:.2f} GB/s"


def _ms(milliseconds: float) -> str:
    return f"{milliseconds:.1f}" if milliseconds else "-"


def print_streaming(document: dict) -> None:
    console = report_console(REPORT_WIDTH)
    rows = document["runs"]
    console.print(_table([*rows, document["serving_prefill"], document["least_budget_prefill"]], document))
    disk, reference = document["disk_medians_bytes_per_s"], document["sequential_read_bytes_per_s"]
    samples = len(document["disk_samples_bytes_per_s"]["sequential"])
    console.print(f"disk, cold, outside serving (medians of {samples}): "
                  f"sequential read in 16 MiB requests one at a time {_rate(disk['sequential'])}, with the "
                  f"store's reader {_rate(disk['sequential_reader'])} (reference: the better, {_rate(reference)}); "
                  f"random experts, a layer's top_k per batch, {_rate(disk['random_experts'])} "
                  f"= {document['random_experts_vs_sequential']:.0%} of the reference")
    if document["serving_prefill_vs_sequential"] is not None:
        console.print(_prefill_line(document["serving_prefill"], document["targets"]["serving_prefill_vs_sequential"]))
    if document["least_budget_prefill_vs_sequential"] is not None:
        console.print(_prefill_line(document["least_budget_prefill"], "informational"))
    console.print(f"streaming, layer pass (each layer's experts in one read batch) / sequential: "
                  f"{_rate(disk['layer_pass'])} / {_rate(reference)} = {document['layer_pass_vs_sequential']:.0%} "
                  f"(target >= {STREAM_TARGET:.0%}): {document['targets']['layer_pass_vs_sequential']}")
    if document["on_demand_vs_sequential"] is not None:
        per_batch = _median(r["experts_per_read_batch"] for r in rows if r.get("experts_per_read_batch"))
        console.print(f"streaming on demand in decode ({per_batch:.1f} experts per read batch) / sequential, "
                      f"informational: {_rate(document['on_demand_bytes_per_s'])} / {_rate(reference)} = "
                      f"{document['on_demand_vs_sequential']:.0%}")


def _prefill_line(prefill: dict, verdict: str) -> str:
    target = f"target >= {STREAM_TARGET:.0%}): {verdict}" if verdict != "informational" else "informational)"
    return (f"streaming while serving, {prefill['run']} ({prefill['num_prompt_tokens']} tokens route "
            f"{prefill['experts_routed_fraction']:.0%} of the experts, the device tier holds {prefill['device_slots']}, "
            f"{prefill['experts_per_read_batch']:.1f} experts per read batch) / sequential: "
            f"{_rate(prefill['stream_bytes_per_s'])} / {_rate(_median(prefill['sequential_around_bytes_per_s']))}, "
            f"median of paired ratios {prefill['vs_sequential']:.0%} ({target}; "
            f"wall clock {_rate(prefill['wall_bytes_per_s'])} over {prefill['ttft_ms'] / 1e3:.2f} s")


def _table(rows: list[dict], document: dict):
    cells = [[row["run"], _ms(row["ttft_ms"]), _ms(row["tpot_ms"]), _ms(row["cpu_tpot_ms"]), fmt(row.get("hit_rate"),
              "{:.1%}"), str(row.get("expert_misses", "-")), fmt(row.get("bytes_read", {}).get("disk"), format_bytes),
              _rate(row.get("stream_bytes_per_s"))] for row in rows]
    return rich_table(f"moestream bench engine --streaming: {document['model']}", ("run", "TTFT ms", "TPOT ms",
                      "TPOT CPU ms", "hit rate", "misses", "disk", "streaming"), cells, no_wrap=True,
                      caption=f"medians over {document['repeats']} repetitions, {document['threads']} torch thread(s); "
                              "offload R: budget R, cold disk, a fresh engine per repetition; prefill B: "
                              "the prompts as one at budget B, cold, a fresh engine")
