"""`moestream bench engine`: the engine end to end on a checkpoint, cold, experts on disk.

Per budget: TTFT, TPOT, stall, overlap, hit rate, disk and host bytes per token and peak RSS of on-demand
LRU (`--sync`), async `lru`, each design's policy, `default` and transformers' disk offload, beside the
all-resident run, plain transformers all resident (its steady TPOT and tokens against ours) and the budget's
physical limit (oracle bytes per token / the misses' link bandwidth). `--host-budget` adds a host tier,
filled before the timed steps (host.py); `--host-compute RULES` runs each async run once per rule, a device-tier
miss in the host tier computed there (the share of misses computed on the host, the bytes copied up and the
tracer's host compute lane per token). Every run is a fresh process, cold; `--memory-cap` reruns each
under a cgroup limit (isolation.py). Targets are ok/missed, never asserted; `--json` also writes the
calibrated cost model for `moestream sim`. Two modes run instead: `--expert-parallel N`, N ranks against one
process (parallel.py), and `--streaming`, the disk while the engine streams from it (streaming.py).
"""

from __future__ import annotations

import sys

from moestream.bench import add_model_flags, add_run_flags, model_dir, write_figures
from moestream.checkpoint.demo import PROMPTS
from moestream.config import EngineConfig
from moestream.parallel.config import ParallelConfig
from moestream.settings import add_arguments

BUDGETS = "0.1,0.25,0.5"
DESIGNS = "moe-infinity,expertflow,fmoe,promoe"  # each design's own policy (the paper systems)
WARMUP_STEPS = 3
REPEATS = 4  # --streaming's


def add_parser(kinds) -> None:
    parser = kinds.add_parser("engine", help="TPOT, stalls, hit rate and peak RSS per policy, cold, against "
                                             "the physical limit")
    add_model_flags(parser)
    add_run_flags(parser, 16, "write the figures (and the calibrated cost model) here")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), metavar="N",
                        help=f"the first N of the {len(PROMPTS)} demo prompts (default all)")
    parser.add_argument("--memory-cap", metavar="auto|MiB",
                        help="run each offloaded run again under a cgroup memory limit (v2, or v1's memory "
                             "controller): auto (floor + dense + budget + 64 MiB) or MiB")
    parser.add_argument("--budgets", default=BUDGETS, help=f"expert budgets, comma separated (default {BUDGETS})")
    parser.add_argument("--designs", default=DESIGNS, help=f"design policies to run (default {DESIGNS}; '' none)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers + accelerate disk offload")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip plain transformers all resident (the reference of the all-resident TPOT)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, metavar="N",
                        help=f"decode steps of each prompt left out of the steady TPOT that compares the "
                             f"all-resident run with plain transformers (default {WARMUP_STEPS})")
    add_arguments(parser, EngineConfig, only=("device", "host_budget", "replay_routing", "direct_io", "native_gemv",
                                              "host_threads"))
    parser.add_argument("--host-compute", default="off", metavar="RULES",
                        help="where a device-tier miss held in the host tier computes, one rule or several comma "
                             "separated (off, share:F, default; default off): each async run of our engine once per "
                             "rule (on-demand LRU: off); each run reports the share of its misses computed on the "
                             "host and the host compute lane's time per token; keeps a host tier apart on the CPU "
                             "(with --host-budget)")
    parser.add_argument("--expert-parallel", type=int, default=0, metavar="N",
                        help="instead: N ranks (torchrun) against one process at the same and at 1/N of the memory")
    add_arguments(parser, ParallelConfig, skip=("expert_parallel_plan",))
    parser.add_argument("--streaming", action="store_true",
                        help="instead: the disk while the engine streams experts from it cold (each budget's "
                             "on-demand reads, a serving prefill at the first and at the least budget) beside "
                             "sequential reads of it")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="--streaming: repetitions; figures are medians")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from moestream.bench.engine.plan import measure
    from moestream.bench.engine.report import print_report
    from moestream.errors import MoestreamError
    from moestream.parallel.ranks import launched

    if launched():
        raise MoestreamError("bench engine starts its ranks itself (--expert-parallel N): run it without torchrun")
    if args.expert_parallel and args.streaming:
        raise MoestreamError("--expert-parallel and --streaming are two modes of bench engine: give one")
    if args.expert_parallel:
        return _expert_parallel(args)
    if args.streaming:
        return _streaming(args)
    document = measure(args)
    print_report(document, args)
    write_figures(document, args.json)
    return 0


def _expert_parallel(args) -> int:
    from moestream.bench.engine.parallel import measure_parallel, print_parallel
    from moestream.checks import at_least

    at_least(1, {"--expert-parallel": args.expert_parallel})
    document = measure_parallel(args, lambda line: print(line, file=sys.stderr, flush=True))
    print_parallel(document)
    write_figures(document, args.json)
    return 0


def _streaming(args) -> int:
    from moestream.bench.engine.plan import check_flags
    from moestream.bench.engine.streaming import measure_streaming, print_streaming
    from moestream.checks import at_least

    budgets, _ = check_flags(args)
    at_least(1, {"--repeats": args.repeats})
    document = measure_streaming(args, model_dir(args), budgets)
    print_streaming(document)
    write_figures(document, args.json)
    return 0
