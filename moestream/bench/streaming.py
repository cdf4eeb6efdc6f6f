"""`moestream bench streaming`: TTFT and TPOT of plain transformers, of our path with every expert resident
and of our path streaming experts from a cold disk; disk bandwidth while streaming beside sequential reads.

Targets (ok/missed, never asserted): a cold serving prefill (the bundled prompts as one, smallest budget;
beside it, informational, the least budget the store accepts) streams >= 80% of sequential bandwidth;
all-resident TPOT within 10% of transformers. For stable figures on a busy machine: fixed torch threads,
ABBA-interleaved resident runs, a fresh cold engine per offloaded run, medians over repetitions, each
prefill paired with the sequential reference around it; TPOT also in process CPU time.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass
from pathlib import Path

from moestream.bench import (add_model_flags, add_run_flags, budget_list, check_run_flags, fmt, model_dir, rich_table,
                             write_figures)
from moestream.cli import at_least
from moestream.threads import torch_threads
from moestream.budget import Budget, format_bytes
from moestream.config import EngineConfig
from moestream.settings import add_arguments

BUDGETS = "0.1,0.25,0.5"
REPEATS = 4
STREAM_TARGET = 0.80  # streaming bandwidth / sequential bandwidth, at least
TPOT_TARGET = 1.10  # all-resident TPOT / transformers TPOT, at most
REPORT_WIDTH = 120  # columns of the report when printing to a file or pipe
PREFILL_COPIES = 4  # the bundled prompts, repeated this often, make the serving prefill's prompt


def add_parser(kinds) -> None:
    parser = kinds.add_parser("streaming", help="resident latency vs transformers and disk streaming bandwidth")
    add_model_flags(parser)
    parser.add_argument("--budgets", default=BUDGETS, help="offloaded expert budgets, comma separated")
    add_run_flags(parser, 16, predictors=False)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="interleaved repetitions; figures are medians")
    add_arguments(parser, EngineConfig, only=("device", "direct_io"))
    parser.set_defaults(handler=run)


def run(args) -> int:
    from moestream.cli.demo import PROMPTS

    check_run_flags(args)
    at_least(1, {"--repeats": args.repeats})
    budgets = budget_list(args.budgets)
    model = model_dir(args)
    with torch_threads(args.threads):
        rows = compare_resident(model, PROMPTS, args)
        offloaded, disk, prefills = compare_streaming(model, PROMPTS, budgets, args)
    rows += offloaded
    summary = summarize(rows, disk, prefills)
    print_report(rows, summary, model, args)
    write_figures({"model": str(model), "device": args.device, "repeats": args.repeats, "threads": args.threads,
                   "runs": rows, **summary}, args.json)
    return 0


def _median(values) -> float:
    return statistics.median(values) if (values := list(values)) else 0.0


# -- one generation, and the two comparisons -------------------------------------------------------


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


class PlainModel:
    """The unmodified transformers model in the checkpoint's dtype, every weight in memory, its own experts
    implementation, run by the engine's greedy step loop (outside `generate`, with the KV cache)."""

    label = "transformers"

    def __init__(self, model_dir: Path, device: str):
        import transformers

        from moestream.checkpoint.index import build_index
        from moestream.runtime.scheduler import eos_ids

        self.checkpoint = build_index(model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        auto_class = getattr(transformers, self.checkpoint.adapter.auto_class)
        self.model = auto_class.from_pretrained(model_dir, dtype="auto").to(device).eval()
        self.eos = eos_ids(self.model.generation_config)
        self.device = device

    def generate(self, prompt: str, max_new_tokens: int) -> Sample:
        _, clock, cpu = self.decode(prompt, max_new_tokens)
        return Sample(clock.ttft_ms, clock.tpot_ms, cpu.tpot_ms())

    def decode(self, prompt: str, max_new_tokens: int):
        """(the greedy new token ids, a StepClock marked at the end of each step with the device synchronized,
        a CpuClock of the steps)."""
        import torch

        from moestream.runtime.metrics import CpuClock, StepClock
        from moestream.runtime.publisher import Publisher
        from moestream.runtime.runner import RUNNERS, BatchCache, Sequence

        seqs = [Sequence(0, list(self.tokenizer(prompt)["input_ids"]))]
        runner = RUNNERS.create(self.checkpoint.adapter.auto_class, self.model, Publisher(), 0, self.device)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.startswith("cuda") else (lambda: None)
        clock, cpu, cache = StepClock(), CpuClock(), BatchCache()
        with torch.inference_mode():
            plan = runner.prefill(0, seqs)
            while plan is not None:
                cpu.begin_iteration()
                seqs[0].output_ids.append(int(runner.run(plan, cache).argmax(dim=-1)[0]))
                done = seqs[0].output_ids[-1] in self.eos or len(seqs[0].output_ids) >= max_new_tokens
                if done:
                    cpu.end_sequence()
                sync()
                clock.mark()
                plan = None if done else runner.decode(len(clock.marks), seqs, cache)
        return seqs[0].output_ids, clock, cpu


class EngineModel:
    """Our engine, one prompt per generation, with a CPU clock among its observers."""

    def __init__(self, engine, label: str):
        from moestream.runtime.metrics import CpuClock

        self.engine = engine
        self.label = label
        self.cpu = CpuClock()
        engine.add_observer(self.cpu)

    def generate(self, prompt: str, max_new_tokens: int) -> Sample:
        self.cpu.marks.clear()
        metrics = self.engine.generate([prompt], max_new_tokens).metrics
        stats = self.engine.store.stats()
        return Sample(metrics.ttft_ms, metrics.tpot_ms, self.cpu.tpot_ms(), metrics.expert_hits,
                      metrics.expert_misses, metrics.bytes_read["disk"], metrics.bytes_read["host"],
                      stats.disk_read_s, stats.disk_batches, metrics.num_prompt_tokens)


def compare_resident(model_dir: Path, prompts, args) -> list[dict]:
    """Transformers vs our engine with every expert resident, interleaved: [transformers row, ours]."""
    from moestream.runtime import Engine

    plain = PlainModel(model_dir, args.device)
    with Engine(model_dir, EngineConfig(device=args.device, expert_budget="1.0", direct_io=args.direct_io,
                                           num_threads=args.threads)) as engine:
        engine.preload()
        ours = EngineModel(engine, "all resident")
        samples: dict[str, list[Sample]] = {plain.label: [], ours.label: []}
        for contender in (plain, ours):  # warm-up, untimed
            contender.generate(prompts[0], 2)
        for repeat in range(args.repeats):
            for prompt in prompts:
                first, second = (plain, ours) if repeat % 2 == 0 else (ours, plain)
                for contender in (first, second, second, first):
                    samples[contender.label].append(contender.generate(prompt, args.max_new_tokens))
    theirs, mine = samples[plain.label], samples[ours.label]
    rows = [_latency_row(plain.label, theirs), _engine_row(ours.label, mine, 2 * len(prompts), "1.0")]
    rows[1] |= {f"{field}_vs_transformers": _paired_ratio(mine, theirs, field) for field in ("tpot_ms", "cpu_tpot_ms")}
    del plain
    gc.collect()
    return rows


def _paired_ratio(mine: list[Sample], theirs: list[Sample], field: str) -> float | None:
    """Median over the ABBA quads (one prompt, one repetition) of our time over theirs: what each
    quad's interleaving cancels (the machine getting busier or quieter) stays out of the ratio."""
    ours, plain = ([getattr(a, field) + getattr(b, field) for a, b in zip(x[::2], x[1::2])] for x in (mine, theirs))
    ratios = [a / b for a, b in zip(ours, plain) if b > 0]
    return _median(ratios) if ratios else None


def compare_streaming(model_dir: Path, prompts, budgets: list[str], args) -> tuple[list[dict], object, list[dict]]:
    """Each repetition: cold serving prefills (at the first budget, at the least), then cold runs per
    budget, a disk sample before each: (rows of the budgets, the ColdReadLog, the prefills' rows)."""
    from moestream.checkpoint.index import build_index
    from moestream.store.bandwidth import ColdReadLog

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
    from moestream.runtime import Engine
    from moestream.store.bandwidth import drop_page_cache

    with Engine(model_dir, EngineConfig(device=args.device, expert_budget=budget, direct_io=args.direct_io,
                                           num_threads=args.threads)) as engine:
        drop_page_cache(model_dir.glob("*.safetensors"))  # loading the dense part may have cached expert bytes
        ours = EngineModel(engine, f"offload {budget}")
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
    stream = _median(r["stream_bytes_per_s"] for r in rows[2:] if r.get("stream_bytes_per_s")) or None
    prefill_ratio = prefill["vs_sequential"]
    layer_ratio = medians["layer_pass"] / reference if reference else None
    tpot_ratio, cpu_ratio = rows[1]["tpot_ms_vs_transformers"], rows[1]["cpu_tpot_ms_vs_transformers"]
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
        "resident_tpot_vs_transformers": tpot_ratio,
        "resident_cpu_tpot_vs_transformers": cpu_ratio,
        "targets": {
            "serving_prefill_vs_sequential": _verdict(prefill_ratio, lambda r: r >= STREAM_TARGET),
            "layer_pass_vs_sequential": _verdict(layer_ratio, lambda r: r >= STREAM_TARGET),
            "resident_tpot_vs_transformers": _verdict(tpot_ratio, lambda r: r <= TPOT_TARGET),
        },
    }


def _verdict(ratio: float | None, meets) -> str:
    return "not measured" if ratio is None else "ok" if meets(ratio) else "missed"


def _rate(bytes_per_s) -> str:
    return "-" if not bytes_per_s else f"{bytes_per_s / 1e9:.2f} GB/s"


def _ms(milliseconds: float) -> str:
    return f"{milliseconds:.1f}" if milliseconds else "-"


def print_report(rows: list[dict], summary: dict, model: Path, args) -> None:
    from moestream.report import report_console

    console = report_console(REPORT_WIDTH)
    console.print(_table([*rows, summary["serving_prefill"], summary["least_budget_prefill"]], model, args))
    disk, reference = summary["disk_medians_bytes_per_s"], summary["sequential_read_bytes_per_s"]
    console.print(f"disk, cold, outside serving (medians of {len(summary['disk_samples_bytes_per_s']['sequential'])}): "
                  f"sequential read in 16 MiB requests one at a time {_rate(disk['sequential'])}, with the "
                  f"store's reader {_rate(disk['sequential_reader'])} (reference: the better, {_rate(reference)}); "
                  f"random experts, a layer's top_k per batch, {_rate(disk['random_experts'])} "
                  f"= {summary['random_experts_vs_sequential']:.0%} of the reference")
    if summary["serving_prefill_vs_sequential"] is not None:
        console.print(_prefill_line(summary["serving_prefill"], summary["targets"]["serving_prefill_vs_sequential"]))
    if summary["least_budget_prefill_vs_sequential"] is not None:
        console.print(_prefill_line(summary["least_budget_prefill"], "informational"))
    console.print(f"streaming, layer pass (each layer's experts in one read batch) / sequential: "
                  f"{_rate(disk['layer_pass'])} / {_rate(reference)} = {summary['layer_pass_vs_sequential']:.0%} "
                  f"(target >= {STREAM_TARGET:.0%}): {summary['targets']['layer_pass_vs_sequential']}")
    if summary["on_demand_vs_sequential"] is not None:
        per_batch = _median(r["experts_per_read_batch"] for r in rows[2:] if r.get("experts_per_read_batch"))
        console.print(f"streaming on demand in decode ({per_batch:.1f} experts per read batch) / sequential, "
                      f"informational: {_rate(summary['on_demand_bytes_per_s'])} / {_rate(reference)} = "
                      f"{summary['on_demand_vs_sequential']:.0%}")
    if summary["resident_tpot_vs_transformers"] is not None:
        console.print(f"TPOT all resident / transformers (median of {rows[1]['num_samples'] // 2} ABBA-paired ratios): "
                      f"{summary['resident_tpot_vs_transformers']:.3f} (target <= {TPOT_TARGET:.2f}): "
                      f"{summary['targets']['resident_tpot_vs_transformers']}; "
                      f"in CPU time {summary['resident_cpu_tpot_vs_transformers']:.3f}")


def _prefill_line(prefill: dict, verdict: str) -> str:
    target = f"target >= {STREAM_TARGET:.0%}): {verdict}" if verdict != "informational" else "informational)"
    return (f"streaming while serving, {prefill['run']} ({prefill['num_prompt_tokens']} tokens route "
            f"{prefill['experts_routed_fraction']:.0%} of the experts, the device tier holds {prefill['device_slots']}, "
            f"{prefill['experts_per_read_batch']:.1f} experts per read batch) / sequential: "
            f"{_rate(prefill['stream_bytes_per_s'])} / {_rate(_median(prefill['sequential_around_bytes_per_s']))}, "
            f"median of paired ratios {prefill['vs_sequential']:.0%} ({target}; "
            f"wall clock {_rate(prefill['wall_bytes_per_s'])} over {prefill['ttft_ms'] / 1e3:.2f} s")


def _table(rows: list[dict], model: Path, args):
    cells = [[row["run"], _ms(row["ttft_ms"]), _ms(row["tpot_ms"]), _ms(row["cpu_tpot_ms"]), fmt(row.get("hit_rate"),
              "{:.1%}"), str(row.get("expert_misses", "-")), fmt(row.get("bytes_read", {}).get("disk"), format_bytes),
              _rate(row.get("stream_bytes_per_s"))] for row in rows]
    return rich_table(f"moestream bench streaming: {model}", ("run", "TTFT ms", "TPOT ms", "TPOT CPU ms", "hit rate",
                      "misses", "disk", "streaming"), cells, no_wrap=True,
                      caption=f"medians over {args.repeats} interleaved repetitions, {args.threads} torch thread(s); "
                              "transformers: every weight in memory; all resident: our path, every expert in the "
                              "device tier; offload R: budget R, cold disk, a fresh engine per repetition; prefill B: "
                              "the bundled prompts as one at budget B, cold, a fresh engine")
