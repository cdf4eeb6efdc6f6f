"""`moestream bench quant --models A,B,...`: one budget (a share of the FIRST checkpoint's expert bytes)
for checkpoints of one model stored differently (bf16/fp32, int8, int4): bytes read from disk and copied
up from the host tier per token, hit rate, stall and TPOT with `default` (or --policy) and on-demand LRU,
each a fresh cold process as in `bench engine` (with --host-budget, a host tier of that share too, filled
before timing: bench/engine/host.py); and each checkpoint's decode cost per expert beside its MLP (the
family's `ExpertMath`, one row, the expert of MoE layer 0), on --device with --threads. Prints figures;
asserts nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from moestream.bench import add_run_flags, check_run_flags, comma_list, write_figures
from moestream.cli import at_least
from moestream.threads import torch_threads
from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.settings import add_arguments

REPEATS = 20


def add_parser(kinds) -> None:
    parser = kinds.add_parser("quant", help="bytes per token, hit rate, stall and TPOT of quantized experts at "
                                            "one memory budget, and the decode cost per expert",
                              description="--policy default (the policy run here unless --policy names another) "
                                          "needs a trained predictor: pass --predictor-dir DIR (from `moestream "
                                          "train-predictor`), or --policy lru.")
    parser.add_argument("--models", required=True, help="checkpoint directories, comma separated (the first is the "
                                                        "reference the budget and the ratios refer to)")
    parser.add_argument("--budget", type=float, default=0.25, help="share of the first checkpoint's expert bytes")
    parser.add_argument("--prompts", type=int, default=1, help="the first N demo prompts")
    add_run_flags(parser, 12)
    add_arguments(parser, EngineConfig, only=("device", "host_budget", "policy", "replay_routing", "direct_io"))
    parser.set_defaults(handler=run, policy="default")  # the asynchronous policy beside on-demand LRU


def _models(args) -> list[Path]:
    models = comma_list(args.models, "--models", Path)
    for model in models:
        if not (model / "config.json").is_file():
            raise MoestreamError(f"--models: no checkpoint at {model}")
    check_run_flags(args, least_tokens=2)
    at_least(1, {"--prompts": args.prompts})
    if not 0 < args.budget <= 1:
        raise MoestreamError(f"--budget must be in (0, 1], got {args.budget}")
    return models


def _check_policy(args, topology) -> None:
    """Refuses, naming the flags, a --policy unknown or that needs a trained predictor (`default`) with no
    --predictor-dir of its kind: before any run, as the isolated runs would refuse it only after the others."""
    from moestream.policies import POLICIES
    from moestream.policies.trained import TrainedPolicy, matching_directory

    try:
        policy = POLICIES.create(args.policy, topology)
    except MoestreamError as error:
        raise MoestreamError(f"--policy: {error}") from None
    try:
        trained = matching_directory(policy, args.predictor_dir)
    except MoestreamError as error:  # a directory that holds no predictor
        raise MoestreamError(f"--predictor-dir: {error}") from None
    if isinstance(policy, TrainedPolicy) and trained is None:
        given = f" of its kind among {', '.join(args.predictor_dir)}" if args.predictor_dir else ""
        raise MoestreamError(f"--policy {args.policy} needs a trained predictor and there is no --predictor-dir"
                             f"{given}: pass --predictor-dir DIR (from `moestream train-predictor`), or --policy lru")


def decode_cost(model: Path, device: str, threads: int) -> tuple[float, float]:
    """(decode ms, MLP ms) of one expert of MoE layer 0 on `device`, one row, `threads` torch threads;
    decode 0 unquantized."""
    import torch

    from moestream.checkpoint.index import build_index
    from moestream.eval.quant_error import read_expert
    from moestream.runtime.layer_experts import expert_mlp
    from moestream.runtime.loader import compute_dtype, expert_decoder

    with torch_threads(threads):
        checkpoint = build_index(model)
        dtype = compute_dtype(checkpoint.config)
        views = checkpoint.experts.views(read_expert(checkpoint.experts.locations[(0, 0)]).to(device))
        decoder = expert_decoder(checkpoint, device)
        decode = (lambda: views) if decoder is None else (lambda: decoder(views))
        math, weights = expert_math(checkpoint), decode()
        x = torch.randn(1, checkpoint.config.get_text_config().hidden_size, dtype=dtype, device=device)  # [1, H]
        decode_ms = _timed(decode, device) if decoder is not None else 0.0
        return decode_ms, _timed(lambda: expert_mlp(math, x, weights), device)


def expert_math(checkpoint):
    """The family's `ExpertMath` of MoE layer 0: its experts module built on meta (no weights), as the
    engine binds it (the module itself through the experts registry, else its swap)."""
    from moestream.runtime.expert_math import FusedExpertMath
    from moestream.runtime.experts import EXPERT_SWAPS
    from moestream.runtime.loader import build_skeleton

    module = build_skeleton(checkpoint).get_submodule(checkpoint.blocks[0].experts_path)
    if checkpoint.adapter.uses_experts_registry:
        return FusedExpertMath(module)
    return EXPERT_SWAPS.create(type(module).__name__, module, None)  # no binding: only its math is called


def _timed(call, device: str) -> float:
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    call()
    sync()
    began = time.perf_counter()
    for _ in range(REPEATS):
        call()
    sync()
    return (time.perf_counter() - began) / REPEATS * 1e3


def measure(args) -> list[dict]:
    from moestream.bench.engine.isolation import run_isolated
    from moestream.bench.engine.spec import RunSpec
    from moestream.checkpoint.index import build_index
    from moestream.cli.demo import PROMPTS

    models = _models(args)
    reference = build_index(models[0]).topology
    _check_policy(args, reference)
    budget = f"{int(args.budget * reference.total_expert_bytes)}B"
    host = _host_budget(args, models, reference, int(args.budget * reference.total_expert_bytes))
    rows = []
    for model in models:
        topology = build_index(model).topology
        decode_ms, mlp_ms = decode_cost(model, args.device, args.threads)
        for policy, sync in ((args.policy, False), ("lru", True)):  # on-demand: --sync LRU
            spec = RunSpec(model=str(model), budget=budget, policy=policy, sync=sync, prompts=PROMPTS[: args.prompts],
                           max_new_tokens=args.max_new_tokens, replay_routing=args.replay_routing,
                           predictor_dirs=tuple(args.predictor_dir), direct_io=args.direct_io,
                           device=args.device, threads=args.threads, host_budget=host)
            result = run_isolated(spec)
            rows.append({"model": str(model), "expert_bytes": topology.expert_bytes, "policy": policy, "sync": sync,
                         "budget": budget, "host_budget": host, "device": args.device, "threads": args.threads,
                         "decode_ms": decode_ms, "mlp_ms": mlp_ms} | result)
            print(_line(rows[-1]), flush=True)
    return rows


def _host_budget(args, models: list[Path], reference, device_bytes: int) -> str:
    """--host-budget in bytes (a ratio: of the first checkpoint's expert bytes, as --budget), each
    checkpoint's host tier checked against the memory left (bench/engine/host.py) before any run."""
    from moestream.bench.engine.host import budget_text
    from moestream.budget import Budget
    from moestream.memory_plan import check_host_room, model_sizes

    text = budget_text(args.host_budget)
    host = f"{Budget.parse(text).resolve(reference.total_expert_bytes)}B"
    for model in models:
        check_host_room(host, model_sizes(model), args.device, device_bytes)
    return host


def _line(row: dict) -> str:
    label = "on-demand lru (--sync)" if row["sync"] else row["policy"]
    return (f"{Path(row['model']).name:>16} {label:>22}: {row['bytes_per_token'] / 1e6:8.2f} MB/token"
            f"{f' (+ {h / 1e6:.2f} MB from the host tier)' if (h := row['host_bytes_per_token']) else ''}, "
            f"hit rate {row['hit_rate']:.2f}, stall {row['stall_ms_per_token']:7.1f} ms/token, "
            f"TPOT {row['tpot_ms']:7.1f} ms; expert {row['expert_bytes'] / 2**20:.2f} MiB, "
            f"decode {row['decode_ms']:.2f} ms beside its MLP {row['mlp_ms']:.2f} ms")


def print_ratios(rows: list[dict]) -> None:
    reference = {(row["policy"], row["sync"]): row for row in rows if row["model"] == rows[0]["model"]}
    for row in rows[len(reference):]:
        base = reference[row["policy"], row["sync"]]
        cut = base["bytes_per_token"] / row["bytes_per_token"] if row["bytes_per_token"] else float("inf")
        speedup = base["tpot_ms"] / row["tpot_ms"] if row["tpot_ms"] else float("nan")
        print(f"{Path(row['model']).name} vs {Path(base['model']).name}, {row['policy']}"
              f"{' --sync' if row['sync'] else ''}: bytes per token / {cut:.2f}, TPOT / {speedup:.2f}")


def run(args) -> int:
    rows = measure(args)
    print_ratios(rows)
    write_figures(rows, args.json)
    return 0
