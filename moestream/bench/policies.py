"""`moestream bench policies`: every registered design, ablation and baseline, the ORACLE and
`default`, side by side on a real routing trace, in the stream and MoE-Beyond protocols, at several
cache ratios and cost models; prediction quality at horizons 1..8; overhead per layer; how far ahead
the replayed tokens reuse their experts (the foresight Belady and the oracle exploit).

Trains on the training trace (by default a seeded 80% of the prompts of --trace) and replays
prompts it has never seen. Prints tables, writes JSON and PNG plots.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from moestream.bench import comma_list, write_figures
from moestream.bench.tools.compare import CompareConfig, Comparison, compare
from moestream.bench.tools.data_dir import resolve_data_dir
from moestream.bench.tools.reuse import ReuseProfile, reuse_profile
from moestream.errors import MoestreamError
from moestream.policies import POLICIES
from moestream.report import report_console, rich_table
from moestream.settings import add_arguments, from_args, same_as, setting
from moestream.trace.format import load_trace

log = logging.getLogger(__name__)
DEV_TRACE = Path("routing") / "deepseek-v2-lite" / "puffin_dev.npz"
REPORT_WIDTH = 160  # columns of the report when printing to a file or pipe


def _comma(kind=str, shown=str) -> dict:
    """The `parse` and `shown` of a flag that lists `kind`s, comma-separated."""
    return {"parse": lambda text, flag: tuple(comma_list(text, flag, kind)),
            "shown": lambda values: ",".join(map(shown, values))}


@dataclass(frozen=True)
class PoliciesFlags:
    """`bench policies`' settings: the held-out split, and CompareConfig's (its defaults, these flags)."""

    test_fraction: float = setting(0.2, "held-out prompts when --train is absent")
    seed: int = setting(0, "seed of the held-out split")
    cache_ratios: tuple[float, ...] = same_as(CompareConfig, "cache_ratios", help="device slots / routed experts",
                                              **_comma(float, "{:.2f}".format))
    cost_models: tuple[str, ...] = same_as(CompareConfig, "cost_models",
                                           help="cost model presets of the stream protocol", **_comma())
    protocols: tuple[str, ...] = same_as(CompareConfig, "protocols", help="replay protocols", **_comma())
    horizons: tuple[int, ...] = same_as(CompareConfig, "horizons", help="prediction horizons (layers ahead)",
                                        **_comma(int))
    num_workers: int = same_as(CompareConfig, "num_workers", help="replays run at once", flag="--workers")


def add_parser(kinds) -> None:
    parser = kinds.add_parser("policies", help="compare every policy on a routing trace")
    parser.add_argument("--trace", type=Path, help="test trace (default: ../shared/data dev trace)")
    parser.add_argument("--tokens", type=Path, help="tokens jsonl of a DeepSeek npz trace")
    parser.add_argument("--train", type=Path, help="training trace (default: 80%% of --trace's prompts)")
    add_arguments(parser, PoliciesFlags, only=("test_fraction", "seed"))
    parser.add_argument("--policies", help="comma-separated names (default: every registered policy)")
    add_arguments(parser, PoliciesFlags, only=("cache_ratios", "cost_models", "protocols", "horizons"))
    parser.add_argument("--max-test-tokens", type=int, help="replay only the first held-out prompts up to this many tokens")
    add_arguments(parser, PoliciesFlags, only=("num_workers",))
    parser.add_argument("--predictor-dir", action="append", default=[], metavar="DIR",
                        help="a trained predictor (train-predictor) used instead of fitting its kind; repeatable")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plot-dir", type=Path, help="write hit-rate plots here")
    parser.set_defaults(handler=run)


def run(args) -> int:
    train, test = _traces(args)
    flags = from_args(PoliciesFlags, args)
    config = CompareConfig(
        policies=tuple(comma_list(args.policies, "--policies") if args.policies else POLICIES.names()),
        predictor_dirs=tuple(args.predictor_dir),
        **{name: getattr(flags, name) for name in ("cache_ratios", "cost_models", "protocols", "horizons",
                                                  "num_workers")},
    )
    result = compare(train, test, config)
    reuse = reuse_profile(test)
    _print(result, config, (train.num_tokens, test.num_tokens), reuse)
    if args.plot_dir:
        _plot(result, args.plot_dir)
    write_figures(_document(result, config, train, test) | {"reuse": asdict(reuse)}, args.json)
    return 0


def _traces(args):
    from moestream.bench.sim.replay import head_tokens
    from moestream.bench.tools.prediction import split_trace

    path = args.trace or _dev_trace()
    trace = load_trace(path, args.tokens)
    if args.train:
        train, test = load_trace(args.train), trace
    else:
        train, test = split_trace(trace, args.test_fraction, args.seed)
    if args.max_test_tokens:
        test = head_tokens(test, args.max_test_tokens)
    return train, test


def _dev_trace() -> Path:
    data = resolve_data_dir()
    if not (data.path / DEV_TRACE).is_file():
        raise MoestreamError(f"no --trace given and no dev trace {DEV_TRACE} under the {data.describe()}")
    return data.path / DEV_TRACE


def _print(result: Comparison, config: CompareConfig, num_tokens: tuple[int, int], reuse: ReuseProfile) -> None:
    console = report_console(REPORT_WIDTH)
    console.print("trained on {} tokens, replayed {} held-out tokens".format(*num_tokens))
    console.print(_reuse_line(reuse))
    for protocol, by_cost in result.replays.items():
        for cost, by_policy in by_cost.items():
            label = protocol if protocol == "moe-beyond" else f"{protocol}, {cost}"
            console.print(_replay_table(label, by_policy, config.cache_ratios, protocol == "stream"))
    console.print(_prediction_table(result, config.horizons))
    for name, reason in result.skipped.items():
        console.print(f"[yellow]{name}: not run: {reason}[/yellow]")
    _print_verdict(console, result)


def _reuse_line(reuse: ReuseProfile) -> str:
    spans = "/".join(str(span) for span in reuse.within_tokens)
    shares = "/".join(f"{100 * share:.0f}" for share in reuse.within_tokens.values())
    return (f"expert reuse in the replayed tokens: next use a median {reuse.median_tokens:g} tokens ahead; "
            f"within {spans} tokens: {shares}%; {100 * reuse.same_sequence_share:.1f}% in the same sequence")


def _replay_table(label: str, by_policy: dict, ratios, with_stall: bool):
    def cell(m: dict) -> str:
        return f"{100 * m['hit_rate']:.1f}%" + (f" / {m['stall_ms_per_token']:.2f}" if with_stall else "")

    return rich_table(f"hit rate{' / stall ms per token' if with_stall else ''} ({label})",
                      ["policy", *(f"{ratio:g}" for ratio in ratios)],
                      [[name, *(cell(by_ratio[ratio]) for ratio in ratios)] for name, by_ratio in by_policy.items()])


def _prediction_table(result: Comparison, horizons):
    def row(name: str, overhead: float) -> list[str]:
        quality = result.prediction.get(name, {})
        f1 = [f"{quality[h]['f1']:.3f}" if h in quality else "-" for h in horizons]
        return [name, *f1, f"{overhead:.1f}", f"{result.fit_seconds.get(name, 0):.1f}"]

    rows = [row(name, overhead) for name, overhead in result.overhead_us_per_layer.items()]
    return rich_table("prediction F1 by horizon (layers ahead); median µs of policy work per layer decision",
                      ["policy", *(f"h={horizon}" for horizon in horizons), "µs/layer decision", "fit s"], rows)


def _print_verdict(console, result: Comparison) -> None:
    """Where `default` is not the best online policy on hit rate and stall, say so."""
    losses = list(default_losses(result))
    if "default" not in result.fit_seconds:
        return
    if not losses:
        console.print("[green]default beats every online policy on hit rate and stall in every setting[/green]")
    for loss in losses:
        console.print(f"[red]default loses: {loss}[/red]")


def default_losses(result: Comparison):
    offline = {name for name in result.fit_seconds if POLICIES.get(name).offline}
    for protocol, by_cost in result.replays.items():
        for cost, by_policy in by_cost.items():
            if "default" not in by_policy:
                continue
            for ratio, mine in by_policy["default"].items():
                for name, by_ratio in by_policy.items():
                    if name == "default" or name in offline:
                        continue
                    other = by_ratio[ratio]
                    if other["hit_rate"] > mine["hit_rate"]:
                        yield f"{protocol} {cost} ratio {ratio:g}: {name} hit rate {other['hit_rate']:.4f} > {mine['hit_rate']:.4f}"
                    if protocol == "stream" and other["stall_ms_per_token"] < mine["stall_ms_per_token"]:
                        yield f"{protocol} {cost} ratio {ratio:g}: {name} stall {other['stall_ms_per_token']:.3f} < {mine['stall_ms_per_token']:.3f}"


def _plot(result: Comparison, plot_dir: Path) -> None:
    from moestream.bench.tools.plots import plot_results

    for protocol, by_cost in result.replays.items():
        for cost, by_policy in by_cost.items():
            name = protocol if protocol == "moe-beyond" else f"{protocol}-{cost}"
            plot_results(by_policy, plot_dir / f"{name}.png", title=f"{protocol} ({cost})")


def _document(result: Comparison, config: CompareConfig, train, test) -> dict:
    replays = {
        protocol: {cost: {name: {f"{r:g}": m for r, m in by_ratio.items()} for name, by_ratio in by_policy.items()}
                   for cost, by_policy in by_cost.items()}
        for protocol, by_cost in result.replays.items()
    }
    return {
        "config": asdict(config),
        "train": {"source": train.source, "num_tokens": train.num_tokens},
        "test": {"source": test.source, "num_tokens": test.num_tokens},
        "replays": replays,
        "prediction": {name: {str(h): q for h, q in by_h.items()} for name, by_h in result.prediction.items()},
        "overhead_us_per_layer": result.overhead_us_per_layer,
        "fit_seconds": result.fit_seconds,
        "skipped": result.skipped,
        "default_losses": list(default_losses(result)),
    }
