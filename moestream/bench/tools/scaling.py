"""The scaling report of `moestream sim --ranks 1,2,4,8`: expert parallelism in the simulator.

Each policy is replayed at every --cache-ratio on every number of ranks, with the experts placed by
--expert-parallel-placement and the ranks joined by --network (moestream.bench.sim.ranks); prints a table of
TPOT, stall, network time and each rank's hit rate; --json and --plot write the results. Knows no
policy by name.
"""

from __future__ import annotations

import copy
from dataclasses import asdict

from rich.table import Table

from moestream.atomic import write_json
from moestream.bench.sim.network import get_network
from moestream.bench.sim.ranks import RanksConfig, RankSetup, simulate_ranks
from moestream.bench.sim.synthetic import SYNTHETIC_PREFIX, shape_of
from moestream.errors import MoestreamError
from moestream.parallel.placement import PLACEMENTS, ActivationStats, make_placement
from moestream.progress import progress_bar
from moestream.report import report_console

REPORT_WIDTH = 180


def check_flags(flags: RanksConfig, args) -> None:
    """Refuses unusable rank flags before any trace is read, naming the flag."""
    get_network(flags.network)
    PLACEMENTS.get(flags.expert_parallel_placement)
    if args.protocol != "stream":
        raise MoestreamError(f"--ranks needs --protocol stream, got {args.protocol!r}")
    several = max(flags.ranks) > 1 and flags.network != "none"
    if several and not flags.hidden_bytes and not str(args.trace).startswith(SYNTHETIC_PREFIX):
        raise MoestreamError("--hidden-bytes is needed with --ranks above 1 and a --network "
                             "(2 x the model's hidden size: 4096 for DeepSeek-V2-Lite)")


def run_ranks(args, flags: RanksConfig, trace, train, policies: dict, configs: list) -> int:
    stats, hidden = _stats(flags, train if train is not None else trace), _hidden_bytes(flags, str(args.trace))
    results = {name: {config.cache_ratio: _scaling(policy, trace, config, flags, stats, hidden) for config in configs}
               for name, policy in policies.items()}
    if args.json is not None:
        write_json(_document(args, flags, configs[0], trace, results) | {"hidden_bytes": hidden}, args.json)
    if args.plot is not None:
        from moestream.bench.tools.plots import plot_scaling

        title = f"{args.trace.name}: {flags.expert_parallel_placement} placement, {flags.network} network"
        plot_scaling(results, args.plot, title)
    _print_table(results)
    return 0


def _stats(flags: RanksConfig, trace):
    if not PLACEMENTS.get(flags.expert_parallel_placement).needs_stats:
        return None
    return ActivationStats.from_routing(trace.experts, trace.topology.num_experts)


def _scaling(policy, trace, config, flags: RanksConfig, stats, hidden: int) -> dict[int, dict]:
    network = get_network(flags.network)
    by_ranks = {}
    for world in progress_bar(flags.ranks, desc=f"sim ratio {config.cache_ratio:g}", unit="world"):
        placement = make_placement(flags.expert_parallel_placement, trace.topology, world, stats)
        setup = RankSetup(placement, network, hidden)
        by_ranks[world] = simulate_ranks(copy.deepcopy(policy), trace, config, setup)
    return by_ranks


def _hidden_bytes(flags: RanksConfig, trace: str) -> int:
    """--hidden-bytes, else the shape's of a synthetic:NAME --trace."""
    if flags.hidden_bytes or not trace.startswith(SYNTHETIC_PREFIX):
        return flags.hidden_bytes
    return shape_of(trace).hidden_bytes


def _document(args, flags: RanksConfig, config, trace, results: dict) -> dict:
    return {
        "trace": str(args.trace),
        "num_tokens": trace.num_tokens,
        "mode": config.mode,
        "cost_model": asdict(config.cost),
        "host_ratio": config.host_cache_ratio,
        "placement": flags.expert_parallel_placement,
        "network": flags.network,
        "policies": {name: {f"{ratio:g}": {str(world): figures for world, figures in by_ranks.items()}
                            for ratio, by_ranks in by_ratio.items()} for name, by_ratio in results.items()},
    }


COLUMNS = ("policy", "ratio", "ranks", "TPOT ms", "speed-up", "resident ms", "stall ms/tok", "network ms/tok",
           "hit rate", "hit rate per rank", "MB/tok per rank")


def _print_table(results: dict) -> None:


    table = Table(title="moestream sim: expert parallelism (stall: the step's wait for expert bytes)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, by_ratio in results.items():
        for ratio, by_ranks in by_ratio.items():
            first = next(iter(by_ranks.values()))["tpot_ms"]
            for world, m in by_ranks.items():
                table.add_row(name, f"{ratio:g}", str(world), *_row(m, first))
    report_console(REPORT_WIDTH).print(table)


def _row(m: dict, first_tpot: float) -> list[str]:
    ranks = m["ranks"]
    return [
        f"{m['tpot_ms']:.2f}",
        f"{first_tpot / m['tpot_ms']:.2f}x" if m["tpot_ms"] else "-",
        f"{m['resident_tpot_ms']:.2f}",
        f"{m['critical_stall_ms_per_token']:.2f}",
        f"{m['network_ms_per_token']:.3f}",
        f"{100 * m['hit_rate']:.1f}%",
        " ".join(f"{100 * r['hit_rate']:.0f}" for r in ranks),
        " ".join(f"{r['bytes_per_token'] / 1e6:.0f}" for r in ranks),
    ]
