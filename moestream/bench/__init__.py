"""Benchmarks: each module (or package) here adds one `moestream bench KIND` (its `add_parser`); below,
the flags and steps several of them share."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path


def add_model_flags(parser) -> None:
    """--model, and the hidden --small (the small demo model, for tests)."""
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)


def model_dir(args) -> Path:
    """--model, else the demo checkpoint."""
    from moestream.cli.demo import demo_checkpoint

    return args.model or demo_checkpoint(args.small)


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


@contextmanager
def torch_threads(threads: int):
    """torch's thread count set to `threads` within, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
