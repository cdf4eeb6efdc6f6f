"""`moestream loadgen`: replays a real arrival trace against a server on this machine and prints its
figures (README). Traces are read where the user keeps them (a path, or a named trace under the data
directory); nothing of them is copied.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moestream.checks import at_least, check_loopback, require_serve_extra


def add_parser(commands) -> None:
    parser = commands.add_parser("loadgen", help="replay an arrival trace against a local server")
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (loopback only)")
    parser.add_argument("--trace", required=True,
                        help="azure-conv, azure-code, mooncake, or a trace file (.csv Azure, .jsonl Mooncake)")
    parser.add_argument("--rps", type=float, required=True, help="mean request rate (the trace's bursts are kept)")
    parser.add_argument("--duration", type=float, required=True, help="seconds of arrivals to replay")
    parser.add_argument("--scale-lengths", type=float, default=1.0,
                        help="multiply the trace's input and output lengths (e.g. 0.05 for a small model)")
    parser.add_argument("--data-dir", type=Path, help="where the workloads folder lies (default: $MOESTREAM_DATA, "
                                                       "else shared/data beside the checkout, else ../shared/data)")
    parser.add_argument("--max-requests", type=int, default=1000, help="send at most this many (default 1000)")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for answers after the last send")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT target of the SLO (default 2000)")
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0, help="TPOT target of the SLO (default 200)")
    parser.add_argument("--api-key", help="bearer key of the server")
    parser.add_argument("--model", help="the model id to name in requests (default: none, the server's)")
    parser.add_argument("--json", type=Path, help="write the figures and every request's measurements here")
    parser.add_argument("--plot", type=Path, help="write the latency CDF plot (PNG) here")
    parser.set_defaults(handler=run)


def run(args) -> int:
    at_least(0, {"--rps": args.rps, "--duration": args.duration, "--scale-lengths": args.scale_lengths,
                 "--max-requests": args.max_requests, "--drain-timeout": args.drain_timeout,
                 "--slo-ttft-ms": args.slo_ttft_ms, "--slo-tpot-ms": args.slo_tpot_ms}, strict=True)
    require_serve_extra()
    import asyncio

    from moestream.atomic import write_json
    from moestream.bench.tools import loadgen, workload
    from moestream.bench.tools.data_dir import resolve_data_dir

    check_loopback(args.url)
    data = resolve_data_dir(args.data_dir)
    print(data.describe(), file=sys.stderr)
    trace = workload.read_trace(workload.trace_path(args.trace, data.path))
    planned = workload.plan(trace, workload.prompt_texts(data.path), args.rps, args.duration,
                            args.scale_lengths, args.max_requests)
    measured, wall = asyncio.run(loadgen.replay(args.url, planned, args.drain_timeout, args.api_key, args.model))
    figures = loadgen.report(measured, wall, loadgen.Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
    print(loadgen.summary(figures))
    if args.json:
        write_json(figures | {"trace": args.trace, "rps": args.rps, "requests": [m.__dict__ for m in measured]}, args.json)
    if args.plot:
        print(f"latency CDF: {loadgen.plot_cdf(measured, args.plot, f'{args.trace} at {args.rps:g} req/s')}",
              file=sys.stderr)
    if measured and not figures["num_completed"]:
        failed = ", ".join(f"{label} x{count}" for label, count in figures["failures"].items())
        print(f"moestream loadgen: error: no request succeeded ({failed})", file=sys.stderr)
        return 1
    return 0
