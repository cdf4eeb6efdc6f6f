"""`moestream predict-eval`: how well a policy's predictor foresees routing, D layers ahead.

Fits the named policy on --train, replays --test (or a seeded --test-fraction of --train, split by
sequence) as a decode stream, and reports precision, recall, F1 (overall and per layer) and
GOODPRED with the lead time of --cost-model. The rule is in moestream.bench.tools.prediction.
"""

from __future__ import annotations

import time
from pathlib import Path

from moestream.atomic import write_json
from moestream.bench.sim.cost import DEFAULT_COST_MODEL, get_cost_model
from moestream.bench.tools.prediction import LeadTimeCost, evaluate_policy, split_trace
from moestream.config import EngineConfig
from moestream.settings import add_arguments


def add_parser(commands) -> None:
    parser = commands.add_parser("predict-eval", help="evaluate a predictor's accuracy and GOODPRED on a trace")
    parser.add_argument("--train", required=True, type=Path, help="trace to fit the policy on (.npz)")
    test = parser.add_mutually_exclusive_group(required=True)
    test.add_argument("--test", type=Path, help="trace to evaluate on (.npz)")
    test.add_argument("--test-fraction", type=float, help="evaluate on this share of --train's sequences instead")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --test-fraction split (default 0)")
    parser.add_argument("--predictor", required=True, metavar="NAME", help="a registered policy (moestream.policies)")
    parser.add_argument("--predictor-dir", type=Path, help="a trained predictor directory (train-predictor)")
    add_arguments(parser, EngineConfig, only=("horizon_layers",))  # D: 0 predicts at the gate
    parser.add_argument("--cost-model", default=DEFAULT_COST_MODEL, help="cost preset for GOODPRED's lead time")
    parser.add_argument("--train-tokens", type=Path, help="tokens jsonl of a DeepSeek --train npz")
    parser.add_argument("--test-tokens", type=Path, help="tokens jsonl of a DeepSeek --test npz")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON to OUT")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from moestream.policies import POLICIES
    from moestream.trace.format import load_trace

    POLICIES.get(args.predictor)  # an unknown name fails before any trace is read
    cost_model = get_cost_model(args.cost_model)
    start = time.perf_counter()
    train = load_trace(args.train, args.train_tokens)
    if args.test is not None:
        test = load_trace(args.test, args.test_tokens)
    else:
        train, test = split_trace(train, args.test_fraction, args.seed)
    topology = test.topology
    cost = LeadTimeCost(cost_model.layer_compute_ms, cost_model.transfer_ms(topology.expert_bytes))
    kwargs = {} if args.predictor_dir is None else {"predictor_dir": args.predictor_dir}
    result = evaluate_policy(args.predictor, train, test, args.horizon_layers, cost, **kwargs)
    split = f"{args.train} ({args.test_fraction} of sequences, seed {args.seed})"
    result |= {
        "train": str(args.train),
        "test": str(args.test) if args.test is not None else split,
        "cost_model": cost_model.name,
        "layer_compute_ms": cost.layer_compute_ms,
        "transfer_ms": cost.transfer_ms,
        "seconds": round(time.perf_counter() - start, 3),
    }
    if args.json is not None:
        write_json(result, args.json)
    print_report(result)
    return 0


def print_report(result: dict) -> None:
    """Per-layer precision, recall and F1, the overall row, and what GOODPRED and zeros mean."""
    from rich.table import Table

    from moestream.report import report_console

    table = Table(title=f"{result['predictor']}, D={result['horizon_layers']} layers ahead, "
                        f"{result['num_tokens']} test tokens")
    for column in ("MoE layer", "precision", "recall", "F1"):
        table.add_column(column, justify="right")
    layers = zip(result["per_layer_precision"], result["per_layer_recall"], result["per_layer_f1"])
    for layer, figures in enumerate(layers):
        table.add_row(str(layer), *(f"{value:.4f}" for value in figures))
    table.add_row("all", *(f"{result[key]:.4f}" for key in ("precision", "recall", "f1")), style="bold")
    console = report_console(80)
    console.print(table)
    for line in _explained(result):
        console.print(line, highlight=False)


def _explained(result: dict) -> list[str]:
    lines = [f"GOODPRED {result['goodpred']:.4f} = precision x fetch rate {result['fetch_rate']:.3f}: the share of "
             f"a top-k prediction whose transfers ({result['transfer_ms']:.2f} ms each, {result['cost_model']}) "
             f"finish within D layers of compute ({result['layer_compute_ms']:.2f} ms each)."]
    if result["fetch_rate"] == 0:
        lead = result["horizon_layers"] * result["layer_compute_ms"]
        lines.append(f"It is 0 because D={result['horizon_layers']} gives {lead:.2f} ms of lead, less than one "
                     "transfer: no prediction can land in time; raise --horizon-layers or use a faster --cost-model.")
    if result["num_predicted"] == 0:
        lines.append(f"{result['predictor']} predicts nothing (it does not prefetch), so precision and recall "
                     "are 0 by convention, not a measured miss.")
    return lines
