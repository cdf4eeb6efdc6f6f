"""`moestream generate`: greedy generation with experts offloaded, printing the text and figures."""

from __future__ import annotations

import argparse
from pathlib import Path

from moestream.errors import MoestreamError


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate text with experts streamed from disk")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors + config.json)")
    parser.add_argument("--prompt", required=True, help="prompt text (tokenized without a chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    add_engine_arguments(parser)
    parser.add_argument("--json", type=Path, help="write text, token ids and figures to this JSON file")
    parser.add_argument("--record-trace", type=Path, help="save the run's routing as a trace file")
    parser.add_argument("--record-hidden", action="store_true", help="include router inputs in the trace")
    parser.set_defaults(handler=run)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig (shared by generate, demo and bench)."""
    parser.add_argument("--expert-budget", default="0.25",
                        help="device-tier budget: a ratio of all routed-expert bytes (0.25, 25%%) or a size (512MiB)")
    parser.add_argument("--host-budget", default="0", help="host-tier budget, same forms (default 0: no host tier)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--policy", default="lru", help="prefetch/eviction policy by name (default lru)")
    parser.add_argument("--predictor-dir", help="trained predictor of the policy (from `moestream train-predictor`)")
    parser.add_argument("--buffered-io", action="store_true", help="read experts through the page cache, not O_DIRECT")


def engine_config(args, **overrides):
    """The EngineConfig the engine flags describe (imported lazily: `moestream --help` stays fast)."""
    from moestream.runtime import EngineConfig

    settings = dict(device=args.device, expert_budget=args.expert_budget, host_budget=args.host_budget,
                    policy=args.policy, predictor_dir=args.predictor_dir, direct_io=not args.buffered_io)
    return EngineConfig(**(settings | overrides))


def run(args) -> int:
    from moestream.runtime import Engine
    from moestream.atomic import write_json

    if args.max_new_tokens < 1:
        raise MoestreamError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    recording = args.record_trace is not None
    config = engine_config(args, publish_gate_probs=recording, publish_hidden=recording and args.record_hidden)
    with Engine(args.model, config, progress=True) as engine:
        recorder = _recorder(engine, args) if args.record_trace else None
        result = engine.generate([args.prompt], max_new_tokens=args.max_new_tokens)
        if recorder is not None:
            _save_trace(recorder, result.seq_ids[0], args)
    print(result.texts[0])
    if args.json:
        write_json(report(result, 0), args.json)
    return 0


def report(result, row: int) -> dict:
    """The JSON record of one prompt of a generation result."""
    m = result.metrics
    return {
        "text": result.texts[row],
        "token_ids": result.token_ids[row],
        "ttft_ms": m.ttft_ms,
        "tpot_ms": m.tpot_ms,
        "expert_hits": m.expert_hits,
        "expert_misses": m.expert_misses,
        "bytes_read": dict(m.bytes_read),
    }


def _recorder(engine, args):
    from moestream.trace.recorder import TraceRecorder

    if not engine.records_traces:
        family = engine.checkpoint.adapter.model_type
        raise MoestreamError(f"--record-trace needs a decoder-only model; {family} routes its encoder "
                             "and decoder tokens apart")
    recorder = TraceRecorder(engine.checkpoint.topology, source=f"moestream generate {args.model}")
    engine.add_observer(recorder)
    return recorder


def _save_trace(recorder, seq_id: int, args) -> None:
    from moestream.trace.format import save_trace

    recorder.set_text(seq_id, args.prompt)
    save_trace(recorder.to_trace(), args.record_trace)
