"""`moestream plan`: what fits where for a checkpoint on this machine, before anything is loaded: the
memory available, what each part takes, the budgets `auto` would choose (the rule is in
moestream.memory_plan) and, with --expert-parallel N, what each rank would own (moestream.parallel.plan).
"""

from __future__ import annotations

from pathlib import Path

from moestream.checks import at_least, require_checkpoint_dir
from moestream.cli.generate import PROMPT_ALLOWANCE
from moestream.config import EngineConfig
from moestream.memory_plan import model_sizes, plan_memory
from moestream.parallel.config import ParallelConfig
from moestream.settings import add_arguments, from_args


def add_parser(commands) -> None:
    parser = commands.add_parser("plan", help="what fits where for a checkpoint, before loading it")
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    add_arguments(parser, EngineConfig, only=("device",))
    parser.add_argument("--kv-tokens", type=int, default=PROMPT_ALLOWANCE,
                        help=f"tokens of KV to leave room for (default {PROMPT_ALLOWANCE})")
    parser.add_argument("--expert-parallel", type=int, default=0, metavar="N",
                        help="also show what each of N ranks would own (default 0: one process)")
    add_arguments(parser, ParallelConfig, skip=("expert_parallel_plan",))
    parser.set_defaults(handler=run)


def run(args) -> int:
    at_least(0, {"--kv-tokens": args.kv_tokens, "--expert-parallel": args.expert_parallel})
    parallel = from_args(ParallelConfig, args)
    require_checkpoint_dir(args.model)
    sizes = model_sizes(args.model)
    plan = plan_memory(sizes, args.device, args.kv_tokens * sizes.kv_bytes_per_token)
    print(f"{args.model}: {sizes.num_moe_layers} MoE layers, {sizes.num_experts} routed experts (top-{sizes.top_k})")
    print(*plan.lines(), sep="\n")
    print(f"(--expert-budget auto would use {plan.expert_budget_bytes}B"
          + (f", --host-budget auto {plan.host_budget_bytes}B)" if args.device.startswith("cuda") else ")"))
    if args.expert_parallel:
        from moestream.checkpoint.index import build_index
        from moestream.parallel.plan import placement_of, plan_lines

        topology = build_index(args.model).topology
        placement, stats = placement_of(parallel, None, topology, args.expert_parallel)
        print("\n".join(plan_lines(placement, topology, stats)))
    return 0
