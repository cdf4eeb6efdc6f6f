"""`moestream sim`: replay a routing trace through policies in the simulator and print their figures.

Each policy loads a matching --predictor-dir or is fitted on --train; without either, one that learns
online runs unfitted (said on stderr) and one that needs a trained predictor is refused before any
policy runs. Each is then replayed at every --cache-ratio under --protocol: `stream` (the
discrete-event simulator with --cost-model) or `moe-beyond` (the MoE-Beyond study's hit-rate
protocol). Prints a table; --json and --plot write the results.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from moestream.atomic import write_json
from moestream.bench import comma_list
from moestream.bench.sim import PRESETS, PROTOCOLS
from moestream.bench.sim.cost import DEFAULT_COST_MODEL
from moestream.checks import at_least
from moestream.errors import MoestreamError
from moestream.report import fmt, rich_table
from moestream.settings import add_arguments, from_args, setting

log = logging.getLogger(__name__)

REPORT_WIDTH = 140  # columns of the table when printing to a file or pipe


@dataclass(frozen=True)
class ReplayConfig:
    """How `moestream sim` replays a trace, beside each replay's SimConfig: the protocol and the cost model."""

    protocol: str = setting("stream", "stream: one token stream in time; moe-beyond: the MoE-Beyond study's scoring",
                            choices=PROTOCOLS.names())
    cost_model: str = setting(DEFAULT_COST_MODEL, f"a preset ({', '.join(sorted(PRESETS))}) or measured:PATH (a "
                                                  "calibration written by `moestream bench engine --json` or `bench "
                                                  "fidelity --json`)")


def add_parser(commands) -> None:
    from moestream.bench.sim.config import CostOverrides, SimConfig
    from moestream.bench.sim.ranks import RanksConfig

    parser = commands.add_parser("sim", help="replay a routing trace through policies in the simulator")
    parser.add_argument("--trace", required=True, type=Path,
                        help="trace to replay (.npz: ours or DeepSeek's), or synthetic:deepseek-v3")
    parser.add_argument("--tokens", type=Path, help="tokens jsonl of a DeepSeek --trace npz")
    parser.add_argument("--max-tokens", type=int, metavar="N",
                        help="replay only the trace's first whole sequences holding N tokens (default: all)")
    parser.add_argument("--policy", required=True, metavar="NAME[,NAME...]", help="registered policies")
    parser.add_argument("--cache-ratio", required=True, metavar="R[,R...]", help="device slots / routed experts, in (0, 1] (or 25%%)")
    add_arguments(parser, ReplayConfig)
    parser.add_argument("--train", type=Path, help="trace to fit the policies on (default: none, unfitted)")
    parser.add_argument("--train-tokens", type=Path, help="tokens jsonl of a DeepSeek --train npz")
    parser.add_argument("--predictor-dir", type=Path, action="append", default=[], metavar="DIR",
                        help="a trained predictor (train-predictor) for the policies of its kind; repeatable")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="hit rate vs ratio and per layer, as PNG")
    add_arguments(parser, SimConfig, skip=("hidden_bytes",))  # RanksConfig's group shows it
    add_arguments(parser.add_argument_group("cost-model overrides"), CostOverrides)
    add_arguments(parser.add_argument_group("expert parallelism"), RanksConfig)
    parser.set_defaults(handler=run)


def run(args) -> int:
    from moestream.bench.sim.ranks import RanksConfig

    names, ratios = _names(args.policy), _ratios(args.cache_ratio)
    configs = [_config(args, ratio) for ratio in ratios]
    ranks = from_args(RanksConfig, args)
    if ranks.ranks is not None:
        from moestream.bench.tools.scaling import check_flags

        check_flags(ranks, args)
    at_least(1, {"--max-tokens": args.max_tokens})
    if configs[0].host_compute != "off" and (ranks.ranks is not None or args.protocol != "stream"):
        raise MoestreamError(f"--host-compute {configs[0].host_compute} needs --protocol stream without --ranks")
    trace, train = _traces(args)
    policies = {name: _prepared(name, trace, train, args) for name in names}  # every refusal before any run
    if ranks.ranks is not None:
        from moestream.bench.tools.scaling import run_ranks

        return run_ranks(args, ranks, trace, train, policies, configs)
    results = {name: _run_policy(name, policy, trace, configs, args) for name, policy in policies.items()}
    _against_oracle(results)
    if args.json is not None:
        write_json(_document(args, configs[0], trace, results), args.json)
    if args.plot is not None:
        from moestream.bench.tools.plots import plot_results

        plot_results(results, args.plot, f"{args.trace.name}: {args.protocol} protocol")
    _print_table(results, args.protocol)
    return 0


def _traces(args):
    """The trace to replay (its first --max-tokens) and the one to fit on (None without --train)."""
    trace = _load(args.trace, args.tokens, args.seed)
    if args.max_tokens is not None:
        from moestream.bench.sim.replay import head_tokens

        trace = head_tokens(trace, args.max_tokens)
    return trace, _load(args.train, args.train_tokens, args.seed + 1) if args.train is not None else None


def _load(path: Path, tokens: Path | None, seed: int):
    """The trace at path, or the synthetic trace a `synthetic:NAME` path names (seeded by --seed)."""
    from moestream.bench.sim.synthetic import SYNTHETIC_PREFIX, synthetic_shape_trace
    from moestream.trace.format import load_trace

    if str(path).startswith(SYNTHETIC_PREFIX):
        return synthetic_shape_trace(str(path), seed=seed)
    return load_trace(path, tokens)


def _names(text: str) -> list[str]:
    from moestream.policies import POLICIES

    names = comma_list(text, "--policy")
    for name in names:
        POLICIES.get(name)  # an unknown name fails before any trace is read
    return names


def _ratios(text: str) -> list[float]:
    ratios = []
    for part in text.split(","):
        percent = part.strip().endswith("%")
        try:
            ratio = float(part.strip().removesuffix("%")) / (100.0 if percent else 1.0)
        except ValueError:
            raise MoestreamError(f"--cache-ratio: {part.strip()!r} is not a ratio (0.25) or a percentage "
                                 "(25%)") from None
        if not 0.0 < ratio <= 1.0:
            raise MoestreamError(f"--cache-ratio must lie in (0, 1], got {ratio}")
        ratios.append(ratio)
    return ratios


def _config(args, ratio: float):
    from dataclasses import fields

    from moestream.bench.sim import SimConfig, get_cost_model
    from moestream.bench.sim.config import CostOverrides
    from moestream.bench.sim.synthetic import SYNTHETIC_PREFIX, shape_of

    cost = from_args(CostOverrides, args).apply(get_cost_model(args.cost_model))
    flags = {f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name)}  # add_parser's
    if not flags.get("hidden_bytes") and str(args.trace).startswith(SYNTHETIC_PREFIX):
        flags["hidden_bytes"] = shape_of(str(args.trace)).hidden_bytes  # a host-computed row's size
    return SimConfig(**flags | {"cache_ratio": ratio, "cost": cost})


def _prepared(name: str, trace, train, args):
    """The policy, its predictor loaded from a matching --predictor-dir or fitted on --train; one that
    needs a trained predictor and has neither is refused, naming both flags."""
    from moestream.bench.sim.protocols import check_compatible
    from moestream.policies import POLICIES
    from moestream.policies.trained import TrainedPolicy, load_matching

    policy = POLICIES.create(name, trace.topology)
    if load_matching(policy, args.predictor_dir) is not None:
        log.info("%s: predictor loaded from a directory", name)
    elif train is not None:
        check_compatible(policy, train)
        policy.fit(train)
    elif isinstance(policy, TrainedPolicy):
        raise MoestreamError(f"{name} needs a trained predictor: pass --train TRACE (fits it here) or "
                               f"--predictor-dir DIR of its kind (from `moestream train-predictor`)")
    elif _learns(policy):
        print(f"moestream: note: policy {name!r} learns from a trace but no --train was given; it runs unfitted", file=sys.stderr)
    return policy


def _run_policy(name: str, policy, trace, configs, args) -> dict[float, dict]:
    from moestream.bench.sim import simulate
    from moestream.progress import progress_bar

    results = {}
    for config in progress_bar(configs, desc=f"sim {name}", unit="ratio"):
        start = time.perf_counter()
        metrics = results[config.cache_ratio] = simulate(copy.deepcopy(policy), trace, config, args.protocol)
        if config.host_compute != "off":  # the saving is against every miss computed on the device
            off = simulate(copy.deepcopy(policy), trace, replace(config, host_compute="off"), args.protocol)
            metrics["host_compute"] = _saving(config.host_compute, metrics, off)
        metrics["replay_seconds"] = round(time.perf_counter() - start, 3)
        log.info("%s at ratio %g: %.1f s", name, config.cache_ratio, time.perf_counter() - start)
    return results


def _against_oracle(results: dict[str, dict[float, dict]]) -> None:
    """With `oracle` among the policies, each policy's bytes per token over the oracle's at its ratio
    (`bytes_vs_oracle`)."""
    oracle = results.get("oracle")
    for by_ratio in results.values() if oracle else ():
        for ratio, metrics in by_ratio.items():
            moved, least = metrics["bytes_per_token"], oracle[ratio]["bytes_per_token"]
            metrics["bytes_vs_oracle"] = moved / least if moved is not None and least else None


def _saving(rule: str, metrics: dict, off: dict) -> dict:
    """What computing misses on the host under rule did against off (all on the device)."""
    stall, off_stall = metrics["stall_ms_per_token"], off["stall_ms_per_token"]
    return {"rule": rule, "host_computed_misses": metrics["host_computed_misses"],
            "device_computed_misses": metrics["device_computed_misses"],
            "off_stall_ms_per_token": off_stall, "stall_saved_ms_per_token": off_stall - stall,
            "off_stall_over_stall": off_stall / stall if stall else None,
            "off_tpot_ms": off["tpot_ms"], "tpot_ms": metrics["tpot_ms"]}


def _learns(policy) -> bool:
    """The policy or its predictor overrides fit()."""
    from moestream.contracts import Policy, Predictor

    return type(policy).fit is not Policy.fit or type(policy.predictor).fit is not Predictor.fit


def _document(args, config, trace, results: dict[str, dict[float, dict]]) -> dict:
    from dataclasses import asdict

    policies = {}
    for name, by_ratio in results.items():
        first = dict(next(iter(by_ratio.values())))  # the first --cache-ratio
        if len(by_ratio) > 1:
            first["by_ratio"] = {f"{ratio:g}": metrics for ratio, metrics in by_ratio.items()}
        policies[name] = first
    return {
        "trace": str(args.trace),
        "num_tokens": trace.num_tokens,
        "protocol": args.protocol,
        "mode": config.mode,
        "batch_size": config.batch_size,
        "horizon_layers": config.horizon_layers,
        "host_compute": config.host_compute,
        "cache_ratios": [ratio for ratio in next(iter(results.values()))],
        "cost_model": asdict(config.cost),
        "policies": policies,
    }


def _print_table(results: dict[str, dict[float, dict]], protocol: str) -> None:
    from moestream.report import report_console

    columns = ["policy", "ratio", "hit rate", "stall ms/tok", "TPOT / resident", "MB/tok", "wasted", "late", "seconds"]
    cells = [[name, f"{ratio:g}", f"{100 * m['hit_rate']:.2f}%", fmt(m["stall_ms_per_token"], "{:.3f}"),
              fmt(m["tpot_ratio_vs_resident"], "{:.2f}x"), fmt(m["bytes_per_token"], lambda b: f"{b / 1e6:.1f}"),
              fmt(m["wasted_prefetch_ratio"], "{:.1%}"), fmt(m["late_prefetch_ratio"], "{:.1%}"),
              f"{m['replay_seconds']:.1f}"] for name, by_ratio in results.items() for ratio, m in by_ratio.items()]
    rows = [m for by_ratio in results.values() for m in by_ratio.values()]
    if any("bytes_vs_oracle" in m for m in rows):
        columns.insert(columns.index("MB/tok") + 1, "/ oracle")
        for cell, m in zip(cells, rows):
            cell.insert(columns.index("/ oracle"), fmt(m["bytes_vs_oracle"], "{:.2f}x"))
    if any("host_compute" in m for m in rows):
        columns[-1:-1] = ["misses host/dev", "saved ms/tok"]
        for cell, m in zip(cells, rows):
            saving = m["host_compute"]
            ratio = saving["off_stall_over_stall"]
            cell[-1:-1] = [f"{saving['host_computed_misses']}/{saving['device_computed_misses']}",
                           f"{saving['stall_saved_ms_per_token']:.3f} ({fmt(ratio, '{:.2f}x')})"]
    report_console(REPORT_WIDTH).print(rich_table(f"moestream sim ({protocol})", columns, cells))
