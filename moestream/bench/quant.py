"""`moestream bench quant --models A,B,...`: one budget (a share of the FIRST checkpoint's expert bytes)
for checkpoints of one model stored differently (bf16/fp32, int8, int4): bytes read from disk and copied
up from the host tier per token, hit rate, stall and TPOT with `default` (or --policy) and on-demand LRU,
each a fresh cold process as in `bench engine` (with --host-budget, a host tier of that share too, filled
before timing: bench/engine/host.py); and each checkpoint's decode cost per expert beside its MLP (the
family's `ExpertMath`, one row, the expert of MoE layer 0), on --device with --threads.

With --quant-kernel K (not exact), for each checkpoint K covers: its MLP per expert from the packed bytes,
and its closeness to the exact path (the reference): the exact path's greedy continuation of each of the
first --prompts demo prompts, then both teacher-forced on it, all resident, and their next-token
distributions compared (top-1 agreement, mean KL, max abs logit error). Prints figures; asserts nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from moestream.bench import add_run_flags, check_run_flags, comma_list, write_figures
from moestream.checks import at_least
from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.settings import add_arguments
from moestream.threads import torch_threads

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
    add_arguments(parser, EngineConfig, only=("device", "host_budget", "policy", "replay_routing", "direct_io",
                                              "quant_kernel"))
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
    from moestream.checkpoint.index import build_index
    from moestream.runtime.layer_experts import expert_mlp
    from moestream.runtime.loader import expert_decoder

    with torch_threads(threads):
        checkpoint = build_index(model)
        views, math, x = _one_expert(checkpoint, device)
        decoder = expert_decoder(checkpoint, device)
        decode = (lambda: views) if decoder is None else (lambda: decoder(views))
        weights = decode()
        decode_ms = _timed(decode, device) if decoder is not None else 0.0
        return decode_ms, _timed(lambda: expert_mlp(math, x, weights), device)


def _one_expert(checkpoint, device: str):
    """(the slot views of expert 0 of MoE layer 0 on `device`, the family's `ExpertMath`, a random row [1, H])."""
    import torch

    from moestream.eval.quant_error import read_expert
    from moestream.runtime.loader import compute_dtype

    views = checkpoint.experts.views(read_expert(checkpoint.experts.locations[(0, 0)]).to(device))
    hidden = checkpoint.config.get_text_config().hidden_size
    return views, expert_math(checkpoint), torch.randn(1, hidden, dtype=compute_dtype(checkpoint.config), device=device)


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


def kernel_figures(model: Path, args) -> dict:
    """--quant-kernel's figures on one checkpoint: {} for exact; why it does not cover the checkpoint; or its
    MLP ms per expert (one row, as decode_cost) and its closeness to the exact path."""
    from moestream.checkpoint.demo import PROMPTS
    from moestream.checkpoint.index import build_index
    from moestream.quant.kernels import QUANT_KERNELS
    from moestream.runtime.loader import expert_decoder

    if args.quant_kernel == "exact":
        return {}
    checkpoint = build_index(model)
    kernel = QUANT_KERNELS.create(args.quant_kernel)
    reason = kernel.refusal(checkpoint, args.device)
    if reason is not None:
        return {"kernel": args.quant_kernel, "kernel_refusal": reason}
    with torch_threads(args.threads):
        views, math, x = _one_expert(checkpoint, args.device)
        packed = kernel(expert_decoder(checkpoint, args.device), checkpoint)
        mlp_ms = _timed(lambda: packed.mlp(math, x, views), args.device)
    error = closeness(model, args.quant_kernel, PROMPTS[: args.prompts], args.max_new_tokens, args.threads)
    return {"kernel": args.quant_kernel, "kernel_mlp_ms": mlp_ms, "kernel_positions": error.positions,
            "kernel_top1_agreement": error.top1_agreement, "kernel_mean_kl": error.mean_kl,
            "kernel_max_abs_logit_error": error.max_abs_logit_error}


class Forced:
    """A TokenSampler that keeps each step's next-token logits [V] and chooses the given tokens (None: the
    argmax: greedy)."""

    cancelled = False

    def __init__(self, tokens: list[int] | None = None):
        self.tokens, self.logits = tokens, []

    def choose(self, logits) -> int:
        self.logits.append(logits.float().clone())
        return int(logits.argmax()) if self.tokens is None else self.tokens[len(self.logits) - 1]

    def stop_reason(self, output_ids: list[int]) -> str | None:
        return None


def closeness(model: Path, kernel: str, prompts, new_tokens: int, threads: int):
    """QuantError of `kernel` against the exact path on one checkpoint, all resident: the exact path's
    greedy continuation of each prompt, then the kernel teacher-forced on it."""
    from moestream.eval.quant_error import compare

    reference = forced_logits(model, "exact", prompts, [None] * len(prompts), new_tokens, threads)
    tokens = [[int(step.argmax()) for step in logits] for logits in reference]
    return compare(reference, forced_logits(model, kernel, prompts, tokens, new_tokens, threads))


def forced_logits(model: Path, kernel: str, prompts, tokens, new_tokens: int, threads: int) -> list:
    """Per prompt, the next-token logits [new_tokens, V] of its sequence choosing `tokens` (None: greedy),
    one sequence at a time, every expert resident, experts computed by `kernel`."""
    import torch

    from moestream.runtime import Engine
    from moestream.runtime.scheduling.scheduler import StaticBatches

    config = EngineConfig(expert_budget="1.0", quant_kernel=kernel, num_threads=threads, direct_io=False)
    logits = []
    with Engine(model, config) as engine:
        for prompt, forced in zip(prompts, tokens, strict=True):
            sampler = Forced(forced)
            scheduler = engine.scheduler(StaticBatches(1))
            scheduler.add(engine.new_sequence(engine.encode(prompt), new_tokens, sampler, ignore_eos=True))
            while engine.step(scheduler) is not None:
                pass
            logits.append(torch.stack(sampler.logits))  # [new_tokens, V]
    return logits


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
    from moestream.checkpoint.demo import PROMPTS
    from moestream.checkpoint.index import build_index

    models = _models(args)
    reference = build_index(models[0]).topology
    _check_policy(args, reference)
    budget = f"{int(args.budget * reference.total_expert_bytes)}B"
    host = _host_budget(args, models, reference, int(args.budget * reference.total_expert_bytes))
    rows = []
    for model in models:
        topology = build_index(model).topology
        decode_ms, mlp_ms = decode_cost(model, args.device, args.threads)
        kernel = kernel_figures(model, args)
        if kernel:
            print(_kernel_line(model, kernel, decode_ms + mlp_ms), flush=True)
        for policy, sync in ((args.policy, False), ("lru", True)):  # on-demand: --sync LRU
            spec = RunSpec(model=str(model), budget=budget, policy=policy, sync=sync, prompts=PROMPTS[: args.prompts],
                           max_new_tokens=args.max_new_tokens, replay_routing=args.replay_routing,
                           predictor_dirs=tuple(args.predictor_dir), direct_io=args.direct_io,
                           device=args.device, threads=args.threads, host_budget=host)
            result = run_isolated(spec)
            rows.append({"model": str(model), "expert_bytes": topology.expert_bytes, "policy": policy, "sync": sync,
                         "budget": budget, "host_budget": host, "device": args.device, "threads": args.threads,
                         "decode_ms": decode_ms, "mlp_ms": mlp_ms} | kernel | result)
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


def _kernel_line(model: Path, figures: dict, exact_ms: float) -> str:
    head = f"{model.name:>16} --quant-kernel {figures['kernel']}"
    if "kernel_refusal" in figures:
        return f"{head}: not measured: {figures['kernel_refusal']}"
    return (f"{head}: MLP {figures['kernel_mlp_ms']:.2f} ms per expert from the packed bytes (decode + MLP "
            f"{exact_ms:.2f}); against the exact path over {figures['kernel_positions']} next-token distributions: "
            f"top-1 agreement {100 * figures['kernel_top1_agreement']:.1f}%, mean KL {figures['kernel_mean_kl']:.3g} "
            f"nats, max abs logit error {figures['kernel_max_abs_logit_error']:.4f}")


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
