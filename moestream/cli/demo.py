"""`moestream demo`: create the demo checkpoint on first use, then compare an offloaded run with a run
where every expert is resident, on a few bundled prompts, and print the figures as a table.

The demo checkpoint has random weights: its text is noise. What the run shows is that the offloaded
tokens are exactly the resident ones, and what offloading costs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moestream.atomic import check_output_file, write_json
from moestream.budget import format_bytes
from moestream.checkpoint.demo import PROMPTS, demo_checkpoint
from moestream.checks import at_least
from moestream.cli.generate import PROMPT_ALLOWANCE, Throughput, check_engine_flags, report, resolve_budgets, totals
from moestream.config import EngineConfig
from moestream.progress import progress_bar
from moestream.report import report_console, rich_table
from moestream.settings import add_arguments, from_args

REPORT_WIDTH = 100  # columns of the table when printing to a file or pipe


def add_parser(commands) -> None:
    parser = commands.add_parser("demo", help="offloaded vs all-resident generation on the demo checkpoint")
    parser.add_argument("--model", type=Path, help="use this checkpoint instead of the demo one")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per prompt (default 24)")
    parser.add_argument("--json", type=Path, help="write the table's figures to this JSON file")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # a tiny demo model, for tests
    add_arguments(parser, EngineConfig)
    parser.set_defaults(handler=run)


def run(args) -> int:
    at_least(1, {"--max-new-tokens": args.max_new_tokens})
    check_engine_flags(args)  # every flag before the demo checkpoint is written
    check_output_file(args.json, "--json")
    model = args.model or demo_checkpoint(args.small)
    resolve_budgets(args, model, kv_tokens=args.max_new_tokens + PROMPT_ALLOWANCE)
    runs = [("offloaded", from_args(EngineConfig, args)), ("all resident", from_args(EngineConfig, args, expert_budget=1.0))]
    rows = [measure(label, model, config, args.max_new_tokens) for label, config in runs]
    print_table(rows, model)
    same = rows[0]["token_ids"] == rows[1]["token_ids"]
    print(f"identical tokens in both runs: {'yes' if same else 'NO'}")
    print(f"sample: {PROMPTS[0]!r} -> {rows[0]['texts'][0]!r}")
    if args.model is None:
        print("  (the demo checkpoint has random weights, so the text is noise: what the run shows is that "
              "offloaded and resident tokens are identical, and what offloading costs)")
    if args.json:
        write_json({"model": str(model), "runs": rows, "identical_tokens": same}, args.json)
    return 0


def measure(label: str, model: Path, config, max_new_tokens: int) -> dict:
    """Generates for each prompt alone; with a full budget, every expert is loaded before timing."""
    from moestream.runtime import Engine

    with Engine(model, config, progress=True) as engine:
        print(f"{label}: {engine.threads}", file=sys.stderr, flush=True)
        if config.expert_budget.ratio == 1.0:
            engine.preload()
        results = [engine.generate([p], max_new_tokens) for p in progress_bar(PROMPTS, desc=label, unit="prompt")]
        total = engine.checkpoint.topology.total_expert_bytes
    rates = Throughput()
    for result in results:
        rates.add(result)
    return {"run": label, "expert_budget": config.expert_budget.percent(total),
            "host_budget": config.host_budget.percent(total), **totals([report(r, 0) for r in results]),
            "prompt_tokens_per_s": rates.prompt_per_s, "generation_tokens_per_s": rates.generation_per_s,
            "token_ids": [r.token_ids[0] for r in results], "texts": [r.texts[0] for r in results]}


def print_table(rows: list[dict], model: Path) -> None:
    host = any(row["bytes_read"]["host"] or row["host_budget"] != "0%" for row in rows)
    columns = ("run", "budget", "TTFT ms", "TPOT ms", "prompt tok/s", "gen tok/s", "hits", "misses", "disk") + (("host",) if host else ())
    note = "" if host else "no host tier (--host-budget 0): misses are read from disk straight into the device tier"
    cells = []
    for row in rows:
        generation = row["generation_tokens_per_s"]
        cells.append([row["run"], row["expert_budget"], f"{row['ttft_ms']:.1f}", f"{row['tpot_ms']:.1f}",
                      f"{row['prompt_tokens_per_s']:.1f}", "n/a" if generation is None else f"{generation:.2f}",
                      str(row["expert_hits"]), str(row["expert_misses"]), format_bytes(row["bytes_read"]["disk"]),
                      *([format_bytes(row["bytes_read"]["host"])] if host else [])])
    table = rich_table(f"moestream demo: {model}", columns, cells, no_wrap=True, caption=note or None)
    report_console(REPORT_WIDTH).print(table)
