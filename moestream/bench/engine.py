"""`moestream bench engine`: TTFT and TPOT of plain transformers, of our path with every expert resident,
and of our path streaming experts on demand from a cold disk at several budgets; plus the disk
bandwidth achieved while streaming beside the disk's sequential-read bandwidth.

Targets (reported as ok/missed, never asserted): streaming reads >= 80% of sequential bandwidth;
with every expert resident, our TPOT within 10% of plain transformers on the same checkpoint.

Built to give stable figures on a busy machine: every run uses the same number of torch threads;
transformers and the all-resident engine are loaded side by side and timed in interleaved order
(ABBA per prompt, the order flipped every repetition); every offloaded run starts from an empty
device tier with a fresh engine, and cold disk samples are taken between those runs, on the
checkpoint's shards in turn. Figures are medians over the repetitions. Streaming bandwidth is
bytes read over the wall time the reader was busy reading (a batch's requests in flight together
count once; compute between batches does not count), in two patterns: on demand while serving (a
layer's misses per read batch: 1 to top_k experts per batch in decode) and a layer pass (the store's
reader taking every expert of a few layers, one read batch per layer). The sequential reference is
the better of two ways of reading a shard front to back (16 MiB requests one at a time; the store's
own reader), so the ratios are not flattered by a weak reference; random expert reads outside
serving show what the disk gives for a decode step's pattern. TPOT is also reported in process CPU
time, which other processes of a shared machine do not inflate.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from moestream.policies.base import Observer

BUDGETS = "0.1,0.25,0.5"
REPEATS = 4
STREAM_TARGET = 0.80  # streaming bandwidth / sequential bandwidth, at least
TPOT_TARGET = 1.10  # all-resident TPOT / transformers TPOT, at most
REPORT_WIDTH = 120  # columns of the report when printing to a file or pipe


def add_parser(kinds) -> None:
    parser = kinds.add_parser("engine", help="engine latency and disk streaming on the demo checkpoint")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--budgets", default=BUDGETS,
                        help=f"offloaded expert budgets, comma separated (default {BUDGETS})")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per prompt (default 16)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"interleaved repetitions; figures are medians over them (default {REPEATS})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every run (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--buffered-io", action="store_true", help="read experts through the page cache")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # the small demo model, for tests
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch

    from moestream.cli.demo import PROMPTS, demo_checkpoint
    from moestream.atomic import write_json

    _check_args(args)
    budgets = _budgets(args.budgets)
    model = args.model or demo_checkpoint(args.small)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = compare_resident(model, PROMPTS, args)
        offloaded, disk = compare_streaming(model, PROMPTS, budgets, args)
    finally:
        torch.set_num_threads(threads)
    rows += offloaded
    summary = summarize(rows, disk)
    print_report(rows, summary, model, args)
    if args.json:
        write_json({"model": str(model), "device": args.device, "repeats": args.repeats, "threads": args.threads,
                   "runs": rows, **summary}, args.json)
    return 0


def _check_args(args) -> None:
    from moestream.errors import MoestreamError

    for flag in ("max_new_tokens", "repeats", "threads"):
        if getattr(args, flag) < 1:
            raise MoestreamError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")


def _budgets(text: str) -> list[str]:
    from moestream.store.config import Budget

    budgets = [part.strip() for part in text.split(",") if part.strip()]
    for budget in budgets:
        Budget.parse(budget)
    return budgets


def _median(values) -> float:
    return statistics.median(values) if (values := list(values)) else 0.0


# -- one generation --------------------------------------------------------------------------------


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


class CpuClock(Observer):
    """Process CPU time at the start of every step and at the end of the last one."""

    def __init__(self):
        self.marks: list[float] = []

    def begin_iteration(self, ctx=None) -> None:
        self.marks.append(time.process_time())

    def end_sequence(self, seq_id: int = 0) -> None:
        self.marks.append(time.process_time())

    def tpot_ms(self) -> float:
        """CPU time per decode step: from the start of step 1 to the end of the last step."""
        steps = len(self.marks) - 2
        return (self.marks[-1] - self.marks[1]) * 1e3 / steps if steps > 0 else 0.0


class PlainModel:
    """The unmodified transformers model, every weight in memory, run by the engine's greedy step loop."""

    label = "transformers"

    def __init__(self, model_dir: Path, device: str):
        import transformers

        from moestream.checkpoint.index import build_index
        from moestream.runtime.engine import eos_ids

        self.checkpoint = build_index(model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        auto_class = getattr(transformers, self.checkpoint.adapter.auto_class)
        self.model = auto_class.from_pretrained(model_dir).to(device).eval()
        self.eos = eos_ids(self.model.generation_config)
        self.device = device

    def generate(self, prompt: str, max_new_tokens: int) -> Sample:
        import torch

        from moestream.runtime.metrics import StepClock
        from moestream.runtime.publisher import Publisher
        from moestream.runtime.runner import RUNNERS, Sequence

        seqs = [Sequence(0, list(self.tokenizer(prompt)["input_ids"]))]
        runner = RUNNERS.create(self.checkpoint.adapter.auto_class, self.model, Publisher(), 0, self.device)
        clock, cpu = StepClock(), CpuClock()
        with torch.inference_mode():
            plan = runner.prefill(0, seqs)
            while plan is not None:
                cpu.begin_iteration()
                seqs[0].output_ids.append(int(runner.run(plan).argmax(dim=-1)[0]))
                done = seqs[0].output_ids[-1] in self.eos or len(seqs[0].output_ids) >= max_new_tokens
                if done:
                    cpu.end_sequence()
                clock.mark()
                plan = None if done else runner.decode(len(clock.marks), seqs)
        return Sample(clock.ttft_ms, clock.tpot_ms, cpu.tpot_ms())


class EngineModel:
    """Our engine, one prompt per generation, with a CPU clock among its observers."""

    def __init__(self, engine, label: str):
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
                      stats.disk_read_s, stats.disk_batches)


def _config(args, budget: str):
    from moestream.runtime import EngineConfig

    return EngineConfig(device=args.device, expert_budget=budget, direct_io=not args.buffered_io)


# -- the two comparisons ---------------------------------------------------------------------------


def compare_resident(model_dir: Path, prompts, args) -> list[dict]:
    """Transformers vs our engine with every expert resident, interleaved: [transformers row, ours]."""
    from moestream.runtime import Engine

    plain = PlainModel(model_dir, args.device)
    with Engine(model_dir, _config(args, "1.0")) as engine:
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


def compare_streaming(model_dir: Path, prompts, budgets: list[str], args) -> tuple[list[dict], dict]:
    """Cold offloaded runs per budget, disk samples between them: (rows, disk samples by method)."""
    from moestream.checkpoint.index import build_index
    from moestream.store.bandwidth import COLD_READ_METHODS, cold_read_samples

    index = build_index(model_dir).experts
    shards = sorted(model_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
    samples: dict[str, list[Sample]] = {budget: [] for budget in budgets}
    disk: dict[str, list[float]] = {method: [] for method in COLD_READ_METHODS}
    for repeat in range(args.repeats):
        for i, budget in enumerate(budgets):
            turn = repeat * len(budgets) + i
            shard = shards[turn % len(shards)]
            for method, rate in cold_read_samples(shard, index, turn, not args.buffered_io).items():
                disk[method].append(rate)
            samples[budget] += cold_run(model_dir, budget, prompts, args)
    return [_engine_row(f"offload {b}", runs, len(prompts), b) for b, runs in samples.items()], disk


def cold_run(model_dir: Path, budget: str, prompts, args) -> list[Sample]:
    """A fresh engine (empty device tier) generating for each prompt in turn."""
    from moestream.runtime import Engine

    with Engine(model_dir, _config(args, budget)) as engine:
        ours = EngineModel(engine, f"offload {budget}")
        return [ours.generate(prompt, args.max_new_tokens) for prompt in prompts]


# -- figures ---------------------------------------------------------------------------------------


def _latency_row(label: str, runs: list[Sample]) -> dict:
    return {
        "run": label,
        "ttft_ms": _median(s.ttft_ms for s in runs),
        "tpot_ms": _median(s.tpot_ms for s in runs),
        "cpu_tpot_ms": _median(s.cpu_tpot_ms for s in runs),
        "num_samples": len(runs),
    }


def _engine_row(label: str, runs: list[Sample], per_repeat: int, budget: str) -> dict:
    """Latency medians; expert counts of one repetition (each repetition routes the same tokens from
    the same state); streaming bandwidth: the median over repetitions."""
    repeats = [runs[i : i + per_repeat] for i in range(0, len(runs), per_repeat)]
    hits, misses = sum(s.hits for s in repeats[0]), sum(s.misses for s in repeats[0])
    batches = sum(s.disk_batches for s in repeats[0])
    return _latency_row(label, runs) | {
        "expert_budget": budget,
        "expert_hits": hits,
        "expert_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "bytes_read": {"disk": sum(s.disk_bytes for s in repeats[0]), "host": sum(s.host_bytes for s in repeats[0])},
        "stream_bytes_per_s": _median(_stream_rate(r) for r in repeats) if misses else None,
        "experts_per_read_batch": misses / batches if batches else None,
    }


def _stream_rate(runs: list[Sample]) -> float:
    seconds = sum(s.disk_read_s for s in runs)
    return sum(s.disk_bytes for s in runs) / seconds if seconds else 0.0


def summarize(rows: list[dict], disk: dict[str, list[float]]) -> dict:
    resident = rows[1]
    medians = {method: _median(rates) for method, rates in disk.items()}
    reference = max(medians["sequential"], medians["sequential_reader"])
    streams = [r["stream_bytes_per_s"] for r in rows[2:] if r.get("stream_bytes_per_s")]
    stream = _median(streams) if streams else None
    stream_ratio = stream / reference if stream and reference else None
    layer_ratio = medians["layer_pass"] / reference if reference else None
    tpot_ratio, cpu_ratio = resident["tpot_ms_vs_transformers"], resident["cpu_tpot_ms_vs_transformers"]
    return {
        "sequential_read_bytes_per_s": reference,
        "disk_medians_bytes_per_s": medians,
        "disk_samples_bytes_per_s": disk,
        "stream_bytes_per_s": stream,
        "stream_vs_sequential": stream_ratio,
        "random_experts_vs_sequential": medians["random_experts"] / reference if reference else None,
        "layer_pass_vs_sequential": layer_ratio,
        "resident_tpot_vs_transformers": tpot_ratio,
        "resident_cpu_tpot_vs_transformers": cpu_ratio,
        "targets": {
            "stream_vs_sequential": _verdict(stream_ratio, lambda r: r >= STREAM_TARGET),
            "layer_pass_vs_sequential": _verdict(layer_ratio, lambda r: r >= STREAM_TARGET),
            "resident_tpot_vs_transformers": _verdict(tpot_ratio, lambda r: r <= TPOT_TARGET),
        },
    }


def _verdict(ratio: float | None, meets) -> str:
    return "not measured" if ratio is None else "ok" if meets(ratio) else "missed"


def _rate(bytes_per_s) -> str:
    return "-" if not bytes_per_s else f"{bytes_per_s / 1e9:.2f} GB/s"


def print_report(rows: list[dict], summary: dict, model: Path, args) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, REPORT_WIDTH)
    console.print(_table(rows, model, args))
    disk, reference = summary["disk_medians_bytes_per_s"], summary["sequential_read_bytes_per_s"]
    console.print(f"disk, cold, outside serving (medians of {len(summary['disk_samples_bytes_per_s']['sequential'])}): "
                  f"sequential read in 16 MiB requests one at a time {_rate(disk['sequential'])}, with the "
                  f"store's reader {_rate(disk['sequential_reader'])} (reference: the better, {_rate(reference)}); "
                  f"random experts, a layer's top_k per batch, {_rate(disk['random_experts'])} "
                  f"= {summary['random_experts_vs_sequential']:.0%} of the reference")
    console.print(f"streaming, layer pass (each layer's experts in one read batch) / sequential: "
                  f"{_rate(disk['layer_pass'])} / {_rate(reference)} = {summary['layer_pass_vs_sequential']:.0%} "
                  f"(target >= {STREAM_TARGET:.0%}): {summary['targets']['layer_pass_vs_sequential']}")
    if summary["stream_vs_sequential"] is not None:
        per_batch = _median(r["experts_per_read_batch"] for r in rows[2:] if r.get("experts_per_read_batch"))
        console.print(f"streaming on demand while serving ({per_batch:.1f} experts per read batch) / sequential: "
                      f"{_rate(summary['stream_bytes_per_s'])} / {_rate(reference)} = "
                      f"{summary['stream_vs_sequential']:.0%} (target >= {STREAM_TARGET:.0%}): "
                      f"{summary['targets']['stream_vs_sequential']}")
    if summary["resident_tpot_vs_transformers"] is not None:
        console.print(f"TPOT all resident / transformers (median of {rows[1]['num_samples'] // 2} ABBA-paired ratios): "
                      f"{summary['resident_tpot_vs_transformers']:.3f} (target <= {TPOT_TARGET:.2f}): "
                      f"{summary['targets']['resident_tpot_vs_transformers']}; "
                      f"in CPU time {summary['resident_cpu_tpot_vs_transformers']:.3f}")


def _table(rows: list[dict], model: Path, args):
    from rich.table import Table

    from moestream.store.config import format_bytes

    table = Table(title=f"moestream bench engine: {model}",
                  caption=f"medians over {args.repeats} interleaved repetitions, {args.threads} torch thread(s); "
                          "transformers: every weight in memory; all resident: our path, every expert in the "
                          "device tier; offload R: budget R, cold disk, a fresh engine per repetition")
    for column in ("run", "TTFT ms", "TPOT ms", "TPOT CPU ms", "hit rate", "misses", "disk", "streaming"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    for row in rows:
        disk = row.get("bytes_read", {}).get("disk")
        table.add_row(row["run"], f"{row['ttft_ms']:.1f}", f"{row['tpot_ms']:.1f}", f"{row['cpu_tpot_ms']:.1f}",
                      f"{row['hit_rate']:.1%}" if "hit_rate" in row else "-", str(row.get("expert_misses", "-")),
                      "-" if disk is None else format_bytes(disk), _rate(row.get("stream_bytes_per_s")))
    return table
