"""`moestream bench token-scheduler`: the continuous batcher with each token scheduler in turn.

--num-seqs sequences run together in decode batches of --max-batch-size; per scheduler (a fresh engine):
distinct experts per decode batch (mean), hit rate, decode throughput, peak RSS and RSS growth. Under
--replay-routing each iteration takes the trace's next rows whatever the sequence (see the report line).
Figures only: nothing is asserted.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from moestream.bench import add_model_flags, comma_list, model_dir, write_figures
from moestream.bench.serving import memory_figures, memory_text
from moestream.bench.tools.data_dir import resolve_data_dir
from moestream.checks import at_least
from moestream.config import BatchingConfig, EngineConfig
from moestream.errors import MoestreamError
from moestream.procfs import status_mib
from moestream.settings import add_arguments, from_args, read_flags


def add_parser(kinds) -> None:
    parser = kinds.add_parser("token-scheduler", help="activated experts, hit rate and throughput per token scheduler")
    add_model_flags(parser)
    parser.add_argument("--schedulers", default="fifo,expertflow", help="token schedulers to compare (default fifo,expertflow)")
    parser.add_argument("--num-seqs", type=int, default=32, help="sequences running together (default 32)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per sequence (default 32)")
    parser.add_argument("--prompt-words", type=int, default=48, help="words kept of each prompt (default 48)")
    parser.add_argument("--data-dir", type=Path, help="where workloads/ lies (default: see moestream.bench.tools.data_dir)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    add_arguments(parser, EngineConfig, skip=("direct_io",))  # buffered reads
    add_arguments(parser, BatchingConfig, skip=("max_num_seqs", "kv_budget_bytes", "token_scheduler"))
    parser.set_defaults(handler=run)


def run(args) -> int:
    at_least(1, {"--num-seqs": args.num_seqs, "--max-tokens": args.max_tokens, "--prompt-words": args.prompt_words})
    read_flags(EngineConfig, args)
    from_args(BatchingConfig, args)  # refuses bad batching flags before the model loads
    from moestream.bench.tools import workload
    from moestream.runtime.scheduling.token_scheduler import TOKEN_SCHEDULERS

    schedulers = comma_list(args.schedulers, "--schedulers", known=TOKEN_SCHEDULERS.names())
    model = model_dir(args)
    data = resolve_data_dir(args.data_dir)
    print(data.describe(), file=sys.stderr)
    texts = workload.prompt_texts(data.path)
    prompts = [" ".join(texts[i % len(texts)].split()[: args.prompt_words]) for i in range(args.num_seqs)]
    rows = [_measure(model, name, prompts, args) for name in schedulers]
    for row in rows:
        print(f"{row['scheduler']:>10}: {row['activated_experts_per_batch']:.1f} experts activated per decode batch "
              f"(of {row['num_experts_total']}), hit rate {row['hit_rate']:.3f}, "
              f"{row['decode_tokens_per_s']:.2f} tokens/s ({row['num_tokens']} tokens in {row['wall_s']:.1f} s); "
              f"{memory_text(row)}")
    if args.replay_routing:
        print("routing replayed: iterations take the trace's next rows whatever the sequence, so a sequence's "
              "last path predicts its next one only as well as any row predicts the next")
    write_figures({"model": str(model), "args": {k: str(v) for k, v in vars(args).items() if k != "handler"},
                   "runs": rows}, args.json)
    return 0


def _measure(model: Path, scheduler: str, prompts: list[str], args) -> dict:
    """One fresh engine; every prompt admitted at once, then steps until all are done."""
    from moestream.runtime import Engine
    from moestream.serving.batching import Batcher
    from moestream.serving.generation import Request
    from moestream.serving.sampling import SamplingParams

    config = from_args(EngineConfig, args, direct_io=False)
    batching = from_args(BatchingConfig, args, max_num_seqs=args.num_seqs, kv_budget_bytes=1 << 40,
                         token_scheduler=scheduler)
    params = SamplingParams(max_tokens=args.max_tokens)
    tokens = []  # one entry per token generated

    def count(request, delta, new_token: bool) -> None:
        tokens.extend([1] if new_token else [])

    with Engine(model, config) as engine:
        batcher = Batcher(engine, batching, count)
        if batcher.paths is None:
            raise MoestreamError(f"continuous batching needs a decoder-only model; "
                                 f"{engine.checkpoint.adapter.model_type} is not one")
        rss_before = status_mib("VmRSS")  # after the engine opened: the growth is the run's
        for prompt in prompts:
            batcher.admit(Request(engine.encode(prompt), params, lambda event: None))
        while batcher.scheduler.waiting:  # prefills are not what is compared
            batcher.step()
        engine.store.reset_stats()
        started, done = time.perf_counter(), len(tokens)
        while batcher.step():
            pass
        wall = time.perf_counter() - started
        stats, topology = engine.store.stats(), engine.checkpoint.topology
        memory = memory_figures(rss_before)  # the engine still open
        batcher.close()
    num_tokens = len(tokens) - done
    print(f"{scheduler}: done in {wall:.1f} s", file=sys.stderr, flush=True)
    return {"scheduler": scheduler, "activated_experts_per_batch": batcher.paths.mean_activated(),
            "num_experts_total": topology.num_layers * topology.num_experts, "hit_rate": stats.hit_rate,
            "decode_tokens_per_s": num_tokens / wall, "num_tokens": num_tokens, "wall_s": wall,
            "bytes_read": dict(stats.bytes_read)} | memory
