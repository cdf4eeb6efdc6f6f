"""`moestream serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) for one checkpoint, with
continuous batching (docs/design.md, Scheduling). Binds 127.0.0.1 unless --host says otherwise; under
--replay-routing a start-up line and every answer say so. Arguments are checked before the heavy imports.
"""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

from moestream.checks import require_serve_extra
from moestream.cli.generate import check_engine_flags, print_lines, resolve_budgets
from moestream.config import EngineConfig, WorkerConfig
from moestream.errors import MoestreamError
from moestream.parallel.config import ParallelConfig
from moestream.settings import add_arguments, from_args

log = logging.getLogger(__name__)


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--served-model-name", help="the model id clients name (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests (default: none, "
                                          "which is allowed on a loopback --host only)")
    parser.add_argument("--allow-unauthenticated", action="store_true", help="serve without --api-key on an "
                        "address other than loopback: anyone who reaches it may use the server")
    add_arguments(parser, WorkerConfig)
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ParallelConfig)
    parser.set_defaults(handler=run, runs_on_ranks=True)


def check_access(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuses an empty --api-key, and no key off loopback (any address of `host`) without --allow-unauthenticated."""
    import ipaddress
    import socket

    if api_key is not None and not api_key.strip():
        raise MoestreamError("--api-key is empty: give a key, or leave the flag out to serve without one "
                             "(loopback only)")
    if api_key is not None or allow_unauthenticated:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return  # it does not resolve: binding says so
    if not all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses):
        raise MoestreamError(f"--host {host} without --api-key lets anyone who reaches it use this server: "
                             "pass --api-key KEY, or --allow-unauthenticated to serve it open")


def run(args) -> int:
    if not 0 <= args.port < 65536:
        raise MoestreamError(f"--port must lie in [0, 65536), got {args.port}")
    check_access(args.host, args.api_key, args.allow_unauthenticated)
    check_engine_flags(args)
    workers = from_args(WorkerConfig, args)
    require_serve_extra()
    from moestream.parallel.launch import open_engine
    from moestream.serving.server import bind

    resolve_budgets(args, args.model, kv_bytes=workers.batching.kv_budget_bytes)
    sock = bind(args.host, args.port)  # before the model loads: a port in use is one line, at once
    with sock, open_engine(args.model, from_args(EngineConfig, args), args, progress=True,
                           on_plan=print_lines) as engine:
        _serve(engine, sock, args, workers)
    print("moestream: stopped: new requests refused, running ones finished or ended", file=sys.stderr)
    return 0


def _serve(engine, sock, args, workers: WorkerConfig) -> None:
    """Serves until Ctrl-C or SIGTERM (uvicorn re-raises the Ctrl-C it handled, once it has shut down)."""
    from moestream.serving import logs
    from moestream.serving.server import Server

    if engine.replay is not None:
        from moestream.runtime.replay import REPLAY_LABEL

        log.warning("moestream: %s from %s: the answers are for measurement only (marked "
                    '"moestream": {"replayed": true})', REPLAY_LABEL, args.replay_routing)
    server = Server(engine, args.served_model_name or args.model.resolve().name, args.host, args.port,
                    args.api_key, workers)
    logging.getLogger("moestream.serve").setLevel(logging.INFO)  # vLLM's lines: start-up, requests, periodic
    logs.startup(engine)
    if args.api_key is None:
        log.warning("moestream: no --api-key: the server is unauthenticated (anyone who reaches %s may use it)",
                    args.host)
    host, port = sock.getsockname()[:2]
    print(f"moestream: serving {args.model} on http://{host}:{port}", file=sys.stderr)
    # What start-up built (torch and the other modules, the engine: ~400k objects) lives as long as the process:
    # frozen, neither the full collections while serving nor the four at interpreter exit walk it (they took 2-3 s
    # after Ctrl-C, issue 43).
    gc.freeze()
    try:
        server.run(sock)
    except KeyboardInterrupt:
        pass
