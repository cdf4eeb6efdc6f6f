"""`moestream bench engine`: TTFT and TPOT of plain transformers, of our path with every expert resident,
and of our path streaming experts on demand from a cold disk at several budgets; plus the disk
bandwidth achieved while streaming beside the disk's sequential-read bandwidth.

Targets (reported, never asserted): streaming reads >= 80% of sequential bandwidth; with every
expert resident, our TPOT within 10% of plain transformers on the same checkpoint.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

BUDGETS = "0.1,0.25,0.5"


def add_parser(kinds) -> None:
    parser = kinds.add_parser("engine", help="engine latency and disk streaming on the demo checkpoint")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--budgets", default=BUDGETS,
                        help=f"offloaded expert budgets, comma separated (default {BUDGETS})")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per prompt (default 16)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--buffered-io", action="store_true", help="read experts through the page cache")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # the small demo model, for tests
    parser.set_defaults(handler=run)


def run(args) -> int:
    from moestream.cli.demo import PROMPTS, demo_checkpoint
    from moestream.errors import MoestreamError
    from moestream.runtime.metrics import save_json

    if args.max_new_tokens < 1:
        raise MoestreamError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    budgets = _budgets(args.budgets)
    model = args.model or demo_checkpoint(args.small)
    rows = [time_transformers(model, PROMPTS, args.max_new_tokens, args.device)]
    rows.append(time_engine(model, "1.0", PROMPTS, args, label="all resident"))
    rows += [time_engine(model, budget, PROMPTS, args, label=f"offload {budget}") for budget in budgets]
    disk = sequential_bandwidth(model, not args.buffered_io)
    summary = summarize(rows, disk)
    print_report(rows, summary, model)
    if args.json:
        save_json({"model": str(model), "device": args.device, "runs": rows, **summary}, args.json)
    return 0


def _budgets(text: str) -> list[str]:
    from moestream.store.config import Budget

    budgets = [part.strip() for part in text.split(",") if part.strip()]
    for budget in budgets:
        Budget.parse(budget)
    return budgets


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def time_transformers(model_dir: Path, prompts, max_new_tokens: int, device: str) -> dict:
    """The unmodified transformers model, every weight in memory, run by the same greedy step loop."""
    import torch
    import transformers

    from moestream.checkpoint.index import build_index
    from moestream.runtime.engine import eos_ids
    from moestream.runtime.metrics import StepClock
    from moestream.runtime.publisher import Publisher
    from moestream.runtime.runner import RUNNERS, Sequence

    checkpoint = build_index(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = getattr(transformers, checkpoint.adapter.auto_class).from_pretrained(model_dir).to(device).eval()
    eos = eos_ids(plain.generation_config)
    ttft, tpot = [], []
    with torch.inference_mode():
        for prompt in prompts:
            seqs = [Sequence(0, list(tokenizer(prompt)["input_ids"]))]
            runner = RUNNERS.create(checkpoint.adapter.auto_class, plain, Publisher(), 0, device)
            clock, plan = StepClock(), runner.prefill(0, seqs)
            while plan is not None:
                token = int(runner.run(plan).argmax(dim=-1)[0])
                clock.mark()
                seqs[0].output_ids.append(token)
                done = token in eos or len(seqs[0].output_ids) >= max_new_tokens
                plan = None if done else runner.decode(len(clock.marks), seqs)
            ttft.append(clock.ttft_ms)
            tpot.append(clock.tpot_ms)
    del plain
    gc.collect()
    return {"run": "transformers", "ttft_ms": _mean(ttft), "tpot_ms": _mean(tpot)}


def time_engine(model_dir: Path, budget: str, prompts, args, label: str) -> dict:
    """Our engine, cold: a fresh device tier (preloaded when the budget holds every expert)."""
    from moestream.runtime import Engine, EngineConfig

    config = EngineConfig(device=args.device, expert_budget=budget, direct_io=not args.buffered_io)
    runs, disk_seconds = [], 0.0
    with Engine(model_dir, config) as engine:
        if config.expert_budget.ratio == 1.0:
            engine.preload()
        for prompt in prompts:
            runs.append(engine.generate([prompt], args.max_new_tokens).metrics)
            disk_seconds += engine.store.stats().disk_read_s
    disk_bytes = sum(m.bytes_read["disk"] for m in runs)
    hits, misses = sum(m.expert_hits for m in runs), sum(m.expert_misses for m in runs)
    return {
        "run": label,
        "expert_budget": budget,
        "ttft_ms": _mean(m.ttft_ms for m in runs),
        "tpot_ms": _mean(m.tpot_ms for m in runs),
        "expert_hits": hits,
        "expert_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "bytes_read": {tier: sum(m.bytes_read[tier] for m in runs) for tier in ("disk", "host")},
        "stream_bytes_per_s": disk_bytes / disk_seconds if disk_seconds else None,
    }


def sequential_bandwidth(model_dir: Path, direct_io: bool) -> float:
    """Cold sequential read of the checkpoint's largest shard (at most 1 GiB of it), bytes per second."""
    from moestream.store.bandwidth import sequential_read_bandwidth

    largest = max(model_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    return sequential_read_bandwidth(largest, nbytes=2**30, direct_io=direct_io)


def summarize(rows: list[dict], disk_bytes_per_s: float) -> dict:
    plain, resident = rows[0], rows[1]
    streams = [r["stream_bytes_per_s"] for r in rows[2:] if r.get("stream_bytes_per_s")]
    return {
        "sequential_read_bytes_per_s": disk_bytes_per_s,
        "stream_vs_sequential": _mean(streams) / disk_bytes_per_s if streams else None,
        "resident_tpot_vs_transformers": resident["tpot_ms"] / plain["tpot_ms"] if plain["tpot_ms"] else None,
    }


def _rate(bytes_per_s) -> str:
    return "-" if not bytes_per_s else f"{bytes_per_s / 1e9:.2f} GB/s"


def print_report(rows: list[dict], summary: dict, model: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from moestream.store.config import format_bytes

    table = Table(title=f"moestream bench engine: {model}", caption="transformers: every weight in memory; "
                  "all resident: our path, every expert in the device tier; offload R: budget R, cold disk")
    for column in ("run", "TTFT ms", "TPOT ms", "hit rate", "misses", "disk", "streaming"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    for row in rows:
        disk = row.get("bytes_read", {}).get("disk")
        table.add_row(row["run"], f"{row['ttft_ms']:.1f}", f"{row['tpot_ms']:.1f}",
                      f"{row['hit_rate']:.1%}" if "hit_rate" in row else "-", str(row.get("expert_misses", "-")),
                      "-" if disk is None else format_bytes(disk), _rate(row.get("stream_bytes_per_s")))
    console = Console()
    console.print(table)
    console.print(f"sequential read: {_rate(summary['sequential_read_bytes_per_s'])}")
    if summary["stream_vs_sequential"] is not None:
        console.print(f"streaming / sequential: {summary['stream_vs_sequential']:.0%} (target >= 80%)")
    if summary["resident_tpot_vs_transformers"] is not None:
        ratio = summary["resident_tpot_vs_transformers"]
        console.print(f"TPOT all resident / transformers: {ratio:.2f} (target <= 1.10)")
