"""`moestream bench serving`: the highest request rate each policy sustains behind the HTTP server.

Per policy (NAME:sync: on demand), the server on loopback replays the trace at each --rate for --duration
seconds or --min-requests; a rate is sustained when every request completes and p99 TPOT stays within
--tpot-factor times the all-resident TPOT (measured first). Prints each run (peak RSS of the one process,
its RSS growth; replayed runs marked), each policy's highest rate and the first's over the last's.
Figures only: nothing is asserted.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path

from moestream.bench import add_model_flags, comma_list, model_dir, write_figures
from moestream.bench.engine.spec import peak_rss_mib
from moestream.bench.tools.data_dir import resolve_data_dir
from moestream.budget import Budget
from moestream.config import BatchingConfig, EngineConfig
from moestream.errors import MoestreamError
from moestream.procfs import status_mib
from moestream.settings import add_arguments, from_args, read_flags


def add_parser(kinds) -> None:
    parser = kinds.add_parser("serving", help="highest request rate per policy behind the server")
    add_model_flags(parser)
    parser.add_argument("--policies", default="default,lru:sync",
                        help="comma-separated policy names, NAME:sync for on demand (default default,lru:sync)")
    parser.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code, mooncake or a trace file")
    parser.add_argument("--data-dir", type=Path, help="where workloads/ lies (default: see moestream.bench.tools.data_dir)")
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="request rates to try, ascending (req/s)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run (default 20)")
    parser.add_argument("--min-requests", type=int, default=20,
                        help="requests per run at least: a low rate's run lasts longer, since a p99 of a few "
                             "requests is their slowest one (default 20)")
    parser.add_argument("--scale-lengths", type=float, default=0.05, help="scale of the trace's lengths (default 0.05)")
    parser.add_argument("--tpot-factor", type=float, default=2.0, help="p99 TPOT limit / all-resident TPOT (default 2)")
    add_arguments(parser, BatchingConfig)
    add_arguments(parser, EngineConfig, skip=("policy", "sync"))  # --policies names both
    parser.add_argument("--all-rates", action="store_true", help="run every rate, also after one is not sustained")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--plot-dir", type=Path, help="write each run's latency CDF plot (PNG) in this directory")
    parser.set_defaults(handler=run)


def _rates(text: str) -> list[float]:
    rates = comma_list(text, "--rates", float)
    if min(rates) <= 0 or rates != sorted(rates):
        raise MoestreamError(f"--rates must be positive and ascending, got {text!r}")
    return rates


def _policies(text: str, predictor_dir) -> list[str]:
    from moestream.policies import POLICIES
    from moestream.policies.trained import TrainedPolicy

    policies = comma_list(text, "--policies")
    for policy in policies:
        name, _, mode = policy.partition(":")
        if mode not in ("", "sync"):
            raise MoestreamError(f"--policies: {policy!r} is not NAME or NAME:sync")
        if issubclass(POLICIES.get(name), TrainedPolicy) and predictor_dir is None:
            raise MoestreamError(f"--policies: {name} needs a trained predictor: pass --predictor-dir DIR "
                                 "(from `moestream train-predictor`)")
    return policies


def run(args) -> int:
    rates, policies, batching = _check(args)
    from moestream.bench.tools import workload

    model = model_dir(args, announce=True)
    data = resolve_data_dir(args.data_dir)
    print(data.describe(), file=sys.stderr)
    trace = workload.read_trace(workload.trace_path(args.trace, data.path))
    serve = functools.partial(_serve_and_replay, model, trace=trace, prompts=workload.prompt_texts(data.path),
                              args=args, batching=batching)
    runs = [serve(Budget(ratio=1.0), "lru", rates[0]) | {"policy": "all-resident"}]
    limit_ms = args.tpot_factor * runs[0]["tpot_ms"]["p50"]
    print(f"all-resident TPOT p50 {runs[0]['tpot_ms']['p50']:.1f} ms: limit p99 TPOT {limit_ms:.1f} ms", flush=True)
    best = {policy: _highest_rate(serve, policy, rates, limit_ms, args, runs) for policy in policies}
    for policy, rate in best.items():
        print(f"{policy}: highest rate sustained {rate:g} req/s")
    if len(best) > 1:
        print(_ratio_line(*list(best.items())[0], *list(best.items())[-1]))
    write_figures({"model": str(model), "trace": args.trace, "tpot_limit_ms": limit_ms, "best_rps": best,
                   "runs": runs}, args.json)
    return 0


def _check(args) -> tuple[list[float], list[str], BatchingConfig]:
    """--rates, --policies and the batching flags; MoestreamError naming a bad flag."""
    from moestream.checks import at_least, require_serve_extra

    read_flags(EngineConfig, args)
    batching = from_args(BatchingConfig, args)
    rates, policies = _rates(args.rates), _policies(args.policies, args.predictor_dir)
    at_least(0, {"--duration": args.duration, "--scale-lengths": args.scale_lengths,
                 "--tpot-factor": args.tpot_factor}, strict=True)
    at_least(1, {"--min-requests": args.min_requests})
    require_serve_extra()
    return rates, policies, batching


def _highest_rate(serve, policy: str, rates: list[float], limit_ms: float, args, runs: list[dict]) -> float:
    """The highest rate the policy sustains (0 if none), trying rates in turn until one is not sustained
    (--all-rates: every one); each run's figures are appended to runs."""
    best = 0.0
    for rate in rates:
        figures = serve(args.expert_budget, policy, rate)
        runs.append(figures | {"policy": policy})
        if _sustained(figures, limit_ms):
            best = max(best, rate)
        elif not args.all_rates:
            break
    return best


def _ratio_line(first: str, rate: float, last: str, base: float) -> str:
    if base:
        return f"{first} sustains {rate / base:.2f}x the rate of {last}"
    if rate:
        return f"{first} sustains {rate:g} req/s, {last} none of the rates tried"
    return f"neither {first} nor {last} sustains any rate tried"


def memory_figures(rss_before_mib: float | None) -> dict:
    """peak_rss_mib: the process's peak resident set so far (runs in one process share it);
    rss_growth_mib: how much the resident set (VmRSS) grew since rss_before_mib (None where unknown)."""
    now = status_mib("VmRSS")
    growth = now - rss_before_mib if now is not None and rss_before_mib is not None else None
    return {"peak_rss_mib": peak_rss_mib(), "rss_growth_mib": growth}


def memory_text(figures: dict) -> str:
    growth = figures["rss_growth_mib"]
    return (f"peak RSS {figures['peak_rss_mib']:.0f} MiB (the process's: its runs share one peak)"
            + (f", RSS {growth:+.0f} MiB over this run" if growth is not None else ""))


def _sustained(figures: dict, limit_ms: float) -> bool:
    p99 = figures["tpot_ms"]["p99"]
    return figures["num_failed"] == 0 and p99 is not None and p99 <= limit_ms


def _serve_and_replay(model: Path, budget: Budget, policy: str, rate: float, trace, prompts, args, batching) -> dict:
    """One server run: a fresh engine (budget, policy), the trace replayed at rate; its figures."""
    from moestream.bench.tools import loadgen, workload
    from moestream.policies import POLICIES
    from moestream.policies.trained import TrainedPolicy
    from moestream.runtime import Engine
    from moestream.runtime.replay import REPLAY_LABEL
    from moestream.serving.server import Server
    from moestream.serving.worker import WorkerConfig

    duration_s = max(args.duration, args.min_requests / rate)
    planned = workload.plan(trace, prompts, rate, duration_s, args.scale_lengths, max_requests=10_000)
    name, _, mode = policy.partition(":")
    predictor_dir = args.predictor_dir if issubclass(POLICIES.get(name), TrainedPolicy) else None
    config = from_args(EngineConfig, args, expert_budget=budget, policy=name, sync=mode == "sync",
                       predictor_dir=predictor_dir)
    with Engine(model, config) as engine:
        if budget == Budget(ratio=1.0):
            engine.preload()
        with Server(engine, model.name, worker_config=WorkerConfig(batching=batching)) as server:
            rss_before = status_mib("VmRSS")  # after the engine opened and the server started: the growth is the run's
            measured, wall = asyncio.run(loadgen.replay(server.url, planned, drain_timeout_s=120.0))
        memory = memory_figures(rss_before)  # the engine still open
    figures = loadgen.report(measured, wall, loadgen.Slo()) | memory | {
        "rps": rate, "expert_budget": str(budget), "mode": "sync" if engine.config.sync else "async",
        "replayed": engine.replay is not None}
    if args.plot_dir:
        label = "all-resident" if budget == Budget(ratio=1.0) else policy.replace(":", "-")
        plot = loadgen.plot_cdf(measured, args.plot_dir / f"{label}-{rate:g}rps.png", f"{label}, {rate:g} req/s")
        figures["plot"] = str(plot)
        print(f"latency CDF: {plot}", file=sys.stderr, flush=True)
    label = f" [{REPLAY_LABEL}]" if figures["replayed"] else ""
    print(f"{policy} @ {budget} budget, {rate:g} req/s{label}: {loadgen.summary(figures)}; {memory_text(figures)}",
          file=sys.stderr, flush=True)
    return figures
