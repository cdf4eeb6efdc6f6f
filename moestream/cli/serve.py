"""`moestream serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) for one checkpoint.

Binds 127.0.0.1 unless --host says otherwise; with --api-key every /v1 request needs the bearer
key. Under --replay-routing a start-up line and every answer say that routing is replayed. Requests
join the running batch between steps (continuous batching, up to --max-num-seqs sequences and
--kv-budget of KV cache); beyond --max-queue waiting requests the server answers 429, and one that
waits over --max-queue-wait-ms 503. Arguments are checked before the heavy imports.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from moestream.cli.generate import add_engine_arguments, check_engine_arguments, engine_config, resolve_auto_budgets
from moestream.errors import MoestreamError

log = logging.getLogger(__name__)


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--served-model-name", help="the model id clients name (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
    add_batching_arguments(parser)
    parser.add_argument("--max-wait-ms", type=float, default=20.0,
                        help="how long the first request reaching an idle engine waits for others (default 20)")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond which 429 is answered")
    parser.add_argument("--max-queue-wait-ms", type=float, default=60_000.0,
                        help="a request not started within this is answered 503 (default 60000)")
    add_engine_arguments(parser)
    parser.set_defaults(handler=run)


def add_batching_arguments(parser) -> None:
    """The continuous batcher's options (serve, bench serving)."""
    parser.add_argument("--max-batch-size", type=int, default=16, help="sequences per decode step (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="running sequences at most; above the batch size, batches decode in turn (default: the batch size)")
    parser.add_argument("--kv-budget", default="1GiB", help="KV cache the running sequences may reserve (default 1GiB)")
    parser.add_argument("--prefill-token-budget", type=int, default=2048, help="prompt tokens per prefill step (default 2048)")
    parser.add_argument("--token-scheduler", default="fifo",
                        help="how running sequences form batches: fifo or expertflow (routing similarity)")
    parser.add_argument("--max-prefill-delay-ms", type=float, default=0.0,
                        help="while sequences decode, a new prompt waits up to this long (or until they finish) "
                             "and prefills with the prompts that came meanwhile: fewer sweeps of the experts "
                             "between decode steps, a later first token (default 0: at the next step)")


def batching_config(args):
    """The BatchingConfig of add_batching_arguments' options."""
    from moestream.budget import Budget
    from moestream.serving.batching import BatchingConfig

    at_least = {"--max-batch-size": (args.max_batch_size, 1), "--prefill-token-budget": (args.prefill_token_budget, 1),
                "--max-num-seqs": (args.max_num_seqs, 0)}
    for flag, (value, least) in at_least.items():
        if value < least:
            raise MoestreamError(f"{flag} must be >= {least}, got {value}")
    kv = Budget.parse(args.kv_budget, "--kv-budget")
    if kv.size_bytes is None:
        raise MoestreamError(f"--kv-budget is a size like 512MiB, got {args.kv_budget!r}")
    return BatchingConfig(args.max_batch_size, args.max_num_seqs, kv.size_bytes, args.prefill_token_budget,
                          args.token_scheduler, args.max_prefill_delay_ms)


def require_serve_extra() -> None:
    """Refuses in one line when the server's libraries (the `serve` extra) are not installed."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client", "httpx")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise MoestreamError(f"this command needs the serve extra: pip install 'moestream[serve]' "
                             f"({', '.join(missing)} missing)")


def run(args) -> int:
    if not 0 <= args.port < 65536:
        raise MoestreamError(f"--port must lie in [0, 65536), got {args.port}")
    check_engine_arguments(args)
    require_serve_extra()
    from moestream.runtime import Engine
    from moestream.serving import logs
    from moestream.serving.server import Server, bind
    from moestream.serving.worker import WorkerConfig

    batching = batching_config(args)
    resolve_auto_budgets(args, args.model, kv_bytes=batching.kv_budget_bytes)
    workers = WorkerConfig(args.max_wait_ms, args.max_queue, args.max_queue_wait_ms, batching)
    sock = bind(args.host, args.port)  # before the model loads: a port in use is one line, at once
    with sock, Engine(args.model, engine_config(args), progress=True) as engine:
        if engine.replay is not None:
            from moestream.runtime.replay import REPLAY_LABEL

            log.warning("moestream: %s from %s: the answers are for measurement only (marked "
                        '"moestream": {"replayed": true})', REPLAY_LABEL, args.replay_routing)
        server = Server(engine, args.served_model_name or args.model.resolve().name, args.host, args.port,
                        args.api_key, workers)
        logging.getLogger("moestream.serve").setLevel(logging.INFO)  # vLLM's lines: start-up, requests, periodic
        logs.startup(engine)
        host, port = sock.getsockname()[:2]
        print(f"moestream: serving {args.model} on http://{host}:{port}", file=sys.stderr)
        try:
            server.run(sock)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once it has shut down
            pass
    print("moestream: stopped: new requests refused, running ones finished or ended", file=sys.stderr)
    return 0
