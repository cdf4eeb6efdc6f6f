"""Benchmarks: each module (or package) here adds one `moestream bench KIND` (its `add_parser`), but tools/,
what they measure with; below, the flags and steps several of them share. The lab: no module outside it
but the command line imports it, and it imports no command."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_flags(parser) -> None:
    """--model, and the hidden --small (the small demo model, for tests)."""
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the demo checkpoint)")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)


def add_run_flags(parser, max_new_tokens: int, json_help: str = "write the figures here", predictors=True) -> None:
    """--max-new-tokens, --threads, --json and (predictors) the repeatable --predictor-dir."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens per prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    parser.add_argument("--json", type=Path, help=json_help)
    if predictors:
        parser.add_argument("--predictor-dir", action="append", default=[], metavar="DIR",
                            help="a trained predictor (train-predictor) for the policies of its kind (the `default` "
                                 "policy needs one); repeatable")


def check_run_flags(args, least_tokens: int = 1) -> None:
    """Refuses, naming the flag, --max-new-tokens below least_tokens, --threads below 1 and, where the bench
    takes them, an unknown --device (or CUDA where there is none) and a --replay-routing that is no file."""
    from moestream.checks import at_least
    from moestream.config import EngineConfig
    from moestream.errors import MoestreamError

    at_least(least_tokens, {"--max-new-tokens": args.max_new_tokens})
    at_least(1, {"--threads": args.threads})
    try:
        EngineConfig(device=getattr(args, "device", "cpu"))
    except MoestreamError as error:
        raise MoestreamError(f"--device: {error}") from None
    if getattr(args, "replay_routing", None) is not None and not Path(args.replay_routing).is_file():
        raise MoestreamError(f"--replay-routing: no trace file at {args.replay_routing}")


def model_dir(args, announce: bool = False) -> Path:
    """--model (refused in one line unless a checkpoint directory), else the demo checkpoint; announce: print
    its checkpoint_line first."""
    from moestream.checkpoint.demo import demo_checkpoint
    from moestream.checks import require_checkpoint_dir

    if args.model is not None:
        require_checkpoint_dir(args.model)
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


def comma_list(text: str, flag: str, kind=str, known=None) -> list:
    """A flag's comma-separated values, each made by kind (and among known, if given); a MoestreamError
    naming the flag on a bad value or an empty list."""
    from moestream.errors import MoestreamError

    names = split_names(text)
    unknown = [name for name in names if known is not None and name not in known]
    try:
        values = [kind(name) for name in names]
    except ValueError:
        raise MoestreamError(f"{flag} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not values:
        raise MoestreamError(f"{flag}: an empty list")
    if unknown:
        raise MoestreamError(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return values


def budget_list(text: str, flag: str = "--budgets") -> list[str]:
    """The comma-separated expert budgets, each checked (BudgetError names the flag and a bad one)."""
    from moestream.budget import Budget

    budgets = split_names(text)
    for budget in budgets:
        Budget.parse(budget, flag)
    return budgets


def write_figures(document, path: Path | None) -> None:
    """Writes the document (JSON, atomically) where --json says, if it says."""
    from moestream.atomic import write_json

    if path:
        write_json(document, path)
