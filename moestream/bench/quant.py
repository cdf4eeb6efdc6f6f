"""`moestream bench quant --models A,B,...`: the same memory budget for checkpoints of one model whose
experts are stored differently (bf16/fp32, int8, int4): bytes read per token, hit rate, stall and
TPOT with `default` (or --policy) and with on-demand LRU (`--sync`), each run a fresh cold process as in
`bench engine`; and each checkpoint's decode cost per expert beside that expert's MLP (one row, one
torch thread, the expert of MoE layer 0 read from disk). The budget is a share of the FIRST
checkpoint's expert bytes, the same bytes for every checkpoint: a quantized one holds more experts
in it. Prints figures; asserts nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from moestream.errors import MoestreamError

REPEATS = 20


def add_parser(kinds) -> None:
    parser = kinds.add_parser("quant", help="bytes per token, hit rate, stall and TPOT of quantized experts at "
                                            "one memory budget, and the decode cost per expert")
    parser.add_argument("--models", required=True, help="checkpoint directories, comma separated (the first is the "
                                                        "reference the budget and the ratios refer to)")
    parser.add_argument("--budget", type=float, default=0.25, help="share of the first checkpoint's expert bytes")
    parser.add_argument("--prompts", type=int, default=1, help="the first N demo prompts")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="tokens per prompt")
    parser.add_argument("--policy", default="default", help="the asynchronous policy beside on-demand LRU")
    parser.add_argument("--predictor-dir", action="append", default=[], metavar="DIR",
                        help="a trained predictor for `default`; repeatable")
    parser.add_argument("--replay-routing", metavar="TRACE", help="follow this trace's routing (measurement only)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--buffered-io", action="store_true", help="read through the page cache, not O_DIRECT")
    parser.set_defaults(handler=run)


def _models(args) -> list[Path]:
    models = [Path(m) for m in args.models.split(",") if m]
    for model in models:
        if not (model / "config.json").is_file():
            raise MoestreamError(f"--models: no checkpoint at {model}")
    if not 0 < args.budget <= 1 or args.prompts < 1 or args.max_new_tokens < 2:
        raise MoestreamError("--budget must be in (0, 1], --prompts >= 1 and --max-new-tokens >= 2")
    if args.replay_routing is not None and not Path(args.replay_routing).is_file():
        raise MoestreamError(f"--replay-routing: no trace file at {args.replay_routing}")
    return models


def decode_cost(model: Path) -> tuple[float, float]:
    """(decode ms, MLP ms) of one expert of MoE layer 0, one row, one torch thread; decode 0 unquantized."""
    import torch
    import torch.nn.functional as F

    from moestream.checkpoint.index import build_index
    from moestream.eval.quant_error import read_expert
    from moestream.quant.decoder import ExpertDecoder
    from moestream.runtime.loader import compute_dtype

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        checkpoint = build_index(model)
        dtype = compute_dtype(checkpoint.config)
        views = checkpoint.experts.views(read_expert(checkpoint.experts.locations[(0, 0)]))
        decoder = None if checkpoint.codec is None else ExpertDecoder(checkpoint.codec, checkpoint.experts.layout, dtype)
        decode = (lambda: views) if decoder is None else (lambda: decoder(views))
        weights = decode()
        up, down = weights["gate_up_proj"], weights["down_proj"]  # [2I, H], [H, I]
        x = torch.randn(1, up.shape[1], dtype=dtype)
        inner = up.shape[0] // 2

        def mlp():
            gate_up = F.linear(x, up)
            return F.linear(F.silu(gate_up[:, :inner]) * gate_up[:, inner:], down)

        return (_timed(decode) if checkpoint.codec is not None else 0.0), _timed(mlp)
    finally:
        torch.set_num_threads(threads)


def _timed(call) -> float:
    call()
    began = time.perf_counter()
    for _ in range(REPEATS):
        call()
    return (time.perf_counter() - began) / REPEATS * 1e3


def measure(args) -> list[dict]:
    from moestream.bench.engine.isolation import run_isolated
    from moestream.bench.engine.spec import RunSpec
    from moestream.checkpoint.index import build_index
    from moestream.cli.demo import PROMPTS

    models = _models(args)
    budget = f"{int(args.budget * build_index(models[0]).topology.total_expert_bytes)}B"
    rows = []
    for model in models:
        topology = build_index(model).topology
        decode_ms, mlp_ms = decode_cost(model)
        for policy, sync in ((args.policy, False), ("lru", True)):  # on-demand: --sync LRU
            spec = RunSpec(model=str(model), budget=budget, policy=policy, sync=sync, prompts=PROMPTS[: args.prompts],
                           max_new_tokens=args.max_new_tokens, replay_routing=args.replay_routing,
                           predictor_dirs=tuple(args.predictor_dir), direct_io=not args.buffered_io)
            result = run_isolated(spec)
            rows.append({"model": str(model), "expert_bytes": topology.expert_bytes, "policy": policy, "sync": sync,
                         "budget": budget, "decode_ms": decode_ms, "mlp_ms": mlp_ms} | result)
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    label = "on-demand lru (--sync)" if row["sync"] else row["policy"]
    return (f"{Path(row['model']).name:>16} {label:>22}: {row['bytes_per_token'] / 1e6:8.2f} MB/token, "
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
    from moestream.atomic import write_json

    rows = measure(args)
    print_ratios(rows)
    if args.json:
        write_json(rows, args.json)
    return 0
