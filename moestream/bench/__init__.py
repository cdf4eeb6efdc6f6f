"""Benchmarks: each module (or package) here adds one `moestream bench KIND` (its `add_parser`); below,
the flags and steps several of them share."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_flags(parser) -> None:
    """--model, and the hidden --small (the small demo model, for tests)."""
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)


def model_dir(args, announce: bool = False) -> Path:
    """--model, else the demo checkpoint; announce: print its checkpoint_line first."""
    from moestream.cli.demo import demo_checkpoint

    model = args.model or demo_checkpoint(args.small)
    if announce:
        print(checkpoint_line(model), flush=True)
    return model


def checkpoint_line(model) -> str:
    """`checkpoint PATH: its shape`, the line a bench prints first."""
    from moestream.checkpoint.index import build_index

    return f"checkpoint {model}: {checkpoint_summary(build_index(model).topology)}"


def checkpoint_summary(topology) -> str:
    """What a bench ran on, in one line: its MoE shape and expert size."""
    return (f"{topology.num_layers} MoE layers x {topology.num_experts} experts (top-{topology.top_k}), "
            f"{topology.expert_bytes / 1e6:.2f} MB per expert, {topology.total_expert_bytes / 1e9:.2f} GB of experts")


def split_names(text: str) -> list[str]:
    """The non-empty parts of a comma-separated list, stripped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def budget_list(text: str) -> list[str]:
    """The comma-separated expert budgets, each checked (BudgetError names a bad one)."""
    from moestream.budget import Budget

    budgets = split_names(text)
    for budget in budgets:
        Budget.parse(budget)
    return budgets


def write_figures(document, path: Path | None) -> None:
    """Writes the document (JSON, atomically) where --json says, if it says."""
    from moestream.atomic import write_json

    if path:
        write_json(document, path)
