"""`moestream generate`: greedy generation with experts offloaded, printing the text and figures.

One prompt (--prompt) or many (--prompts-file, one per line, run in batches of --batch-size);
--record-trace files every prompt's routing as one sequence of a single trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moestream.errors import MoestreamError


def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate text with experts streamed from disk")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors + config.json)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized without a chat template)")
    source.add_argument("--prompts-file", type=Path, help="text file of prompts, one per line (blank lines skipped)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts of --prompts-file generated together (default 1); figures are per batch")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    add_engine_arguments(parser)
    parser.add_argument("--json", type=Path,
                        help="write text, token ids and figures to this JSON file (a list with --prompts-file)")
    parser.add_argument("--record-trace", type=Path, help="save the run's routing as a trace file")
    parser.add_argument("--record-hidden", action="store_true",
                        help="include router inputs and token embeddings in the trace")
    parser.set_defaults(handler=run)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig (shared by generate, demo and bench)."""
    parser.add_argument("--expert-budget", default="0.25",
                        help="device-tier budget: a ratio of all routed-expert bytes (0.25, 25%%) or a size (512MiB)")
    parser.add_argument("--host-budget", default="0",
                        help="host-tier budget, same forms (default 0: no host tier); on the CPU without --sync "
                             "it joins the expert budget, since host and device memory are one tier there")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--policy", default="lru", help="prefetch/eviction policy by name (default lru)")
    parser.add_argument("--predictor-dir", help="trained predictor of the policy (from `moestream train-predictor`)")
    parser.add_argument("--buffered-io", action="store_true", help="read experts through the page cache, not O_DIRECT")
    parser.add_argument("--sync", action="store_true",
                        help="fetch experts on demand on the compute thread (the baseline); default: beside compute")
    parser.add_argument("--chunk-size", default="0",
                        help="largest piece of one expert transfer, e.g. 256KiB (default 0: one weight matrix)")
    parser.add_argument("--no-reorder", action="store_true",
                        help="compute a layer's experts in expert order instead of resident ones first")


def engine_config(args, **overrides):
    """The EngineConfig the engine flags describe (imported lazily: `moestream --help` stays fast)."""
    from moestream.runtime import EngineConfig

    from moestream.store.config import parse_size

    settings = dict(device=args.device, expert_budget=args.expert_budget, host_budget=args.host_budget,
                    policy=args.policy, predictor_dir=args.predictor_dir, direct_io=not args.buffered_io,
                    sync=args.sync, chunk_bytes=parse_size(args.chunk_size, "--chunk-size"),
                    reorder=not args.no_reorder)
    return EngineConfig(**(settings | overrides))


def run(args) -> int:
    from moestream.atomic import write_json

    if args.max_new_tokens < 1:
        raise MoestreamError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise MoestreamError(f"--batch-size must be >= 1, got {args.batch_size}")
    prompts = [args.prompt] if args.prompts_file is None else read_prompts(args.prompts_file)
    records = _generate(args, prompts)
    if args.prompts_file is None:
        print(records[0]["text"])
    else:
        for number, record in enumerate(records, 1):
            print(f"--- prompt {number}/{len(records)} ---\n{record['text']}")
    if args.json:
        write_json(records[0] if args.prompts_file is None else records, args.json)
    return 0


def read_prompts(path: Path) -> list[str]:
    """The non-blank lines of a prompts file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise MoestreamError(f"prompts file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise MoestreamError(f"cannot read prompts file {path}: {error}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise MoestreamError(f"prompts file {path} has no prompts (one per line, blank lines skipped)")
    return prompts


def _generate(args, prompts: list[str]) -> list[dict]:
    """Runs the prompts in batches and returns one JSON record per prompt (the trace saved if asked)."""
    from moestream.runtime import Engine

    recording = args.record_trace is not None
    config = engine_config(args, publish_gate_probs=recording, publish_hidden=recording and args.record_hidden)
    many = args.prompts_file is not None
    records = []
    with Engine(args.model, config, progress=True) as engine:
        recorder = _recorder(engine, args) if recording else None
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start: start + args.batch_size]
            result = engine.generate(batch, max_new_tokens=args.max_new_tokens)
            for row, prompt in enumerate(batch):
                if recorder is not None:
                    recorder.set_text(result.seq_ids[row], prompt)
                extra = {"prompt": prompt, "batch": start // args.batch_size} if many else {}
                records.append(report(result, row) | extra)
        if recorder is not None:
            _save_trace(recorder, args.record_trace)
    return records


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
        "stall_ms": m.stall_ms,
        "transfer_ms": m.transfer_ms,
    }


def _recorder(engine, args):
    from moestream.trace.recorder import TraceRecorder

    if not engine.records_traces:
        family = engine.checkpoint.adapter.model_type
        raise MoestreamError(f"--record-trace needs a decoder-only model; {family} routes its encoder "
                             "and decoder tokens apart")
    kind = _inputs_recorder_class() if args.record_hidden else TraceRecorder
    recorder = kind(engine.checkpoint.topology, source=f"moestream generate {args.model}")
    engine.add_observer(recorder)
    return recorder


def _save_trace(recorder, path: Path) -> None:
    from moestream.trace.format import save_trace

    save_trace(recorder.to_trace(), path)


def _inputs_recorder_class():
    from moestream.trace.recorder import TraceRecorder

    class InputsRecorder(TraceRecorder):
        """A recorder that also asks the engine for each token's input embedding."""

        needs_embeddings = True

    return InputsRecorder
