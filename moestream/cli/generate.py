"""`moestream generate`: greedy generation with experts offloaded, text on stdout, figures on stderr.

One prompt (--prompt) or many (--prompts-file, one per line, run in batches of --batch-size);
--record-trace files every prompt's routing as one sequence of a single trace. With a batch of one
the text is streamed as tokens are produced (Ctrl-C keeps what was printed); one summary line goes to
stderr at the end. Paths and budgets are checked before the heavy imports (torch, transformers).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from moestream.atomic import check_output_file, write_json
from moestream.budget import Budget, format_bytes
from moestream.checks import at_least, require_checkpoint_dir
from moestream.config import EngineConfig
from moestream.errors import BudgetError, MoestreamError
from moestream.memory_plan import AUTO, check_host_room, model_sizes, plan_memory, sizes_of
from moestream.parallel.config import ParallelConfig
from moestream.settings import add_arguments, from_args, read_flags

PROMPT_ALLOWANCE = 2048  # prompt tokens a sequence may bring, in the KV that an auto budget leaves room for

def add_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate text with experts streamed from disk")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors + config.json)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized without a chat template)")
    source.add_argument("--prompts-file", type=Path, help="text file of prompts, one per line (blank lines skipped)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts of --prompts-file generated together (default 1); figures are per batch")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ParallelConfig)
    parser.add_argument("--json", type=Path,
                        help="write text, token ids and figures to this JSON file (a list with --prompts-file)")
    parser.add_argument("--record-trace", type=Path, help="save the run's routing as a trace file")
    parser.add_argument("--record-hidden", action="store_true",
                        help="include router inputs and token embeddings in the trace")
    parser.set_defaults(handler=run, runs_on_ranks=True)


def check_engine_flags(args) -> None:
    """Refuses a bad engine flag, placement name or --model before the heavy imports (budgets: `resolve_budgets`)."""
    read_flags(EngineConfig, args)
    from_args(EngineConfig, args, **{name: 1.0 for name in ("expert_budget", "host_budget")
                                     if getattr(args, name) == AUTO})
    from_args(ParallelConfig, args)
    if args.model is not None:
        require_checkpoint_dir(args.model)


def check_budgets(args, model: Path) -> None:
    """Refuses, from the safetensors headers before anything loads, a device budget that cannot serve one
    token of one layer and a host budget over the memory left (or, on CUDA, that cannot be pinned)."""
    from moestream.checkpoint.index import build_index
    from moestream.store.config import StoreConfig

    config, index = from_args(EngineConfig, args), build_index(model)
    try:
        slots = StoreConfig.of(config).device_slots(index.topology)
    except BudgetError as error:
        raise BudgetError(f"--expert-budget: {error}") from None
    check_host_room(config.host_budget, sizes_of(index), config.device, slots * index.topology.expert_bytes)


def resolve_budgets(args, model: Path, kv_tokens: int = 0, kv_bytes: int = 0) -> None:
    """Replaces an `auto` budget by the bytes `moestream.memory_plan` finds free (and says so); then `check_budgets`."""
    if AUTO not in (args.expert_budget, args.host_budget):
        return check_budgets(args, model)
    sizes = model_sizes(model)
    plan = plan_memory(sizes, args.device, kv_bytes or kv_tokens * sizes.kv_bytes_per_token)
    if args.expert_budget == AUTO:
        args.expert_budget = Budget(size_bytes=plan.expert_budget_bytes)
    if args.host_budget == AUTO:
        args.host_budget = Budget(size_bytes=plan.host_budget_bytes)
    print("auto budgets:", *plan.lines(), sep="\n", file=sys.stderr)
    check_budgets(args, model)


def run(args) -> int:
    at_least(1, {"--max-new-tokens": args.max_new_tokens, "--batch-size": args.batch_size})
    if args.prompt == "":
        raise MoestreamError("--prompt is empty: give the text to continue")
    check_engine_flags(args)
    prompts = [args.prompt] if args.prompts_file is None else read_prompts(args.prompts_file)
    check_output_file(args.json, "--json")
    check_output_file(args.record_trace, "--record-trace")
    resolve_budgets(args, args.model, kv_tokens=args.batch_size * (args.max_new_tokens + PROMPT_ALLOWANCE))
    records, rates = _generate(args, prompts)
    print(summary(records, rates), file=sys.stderr)
    if args.json:
        write_json(records[0] if args.prompts_file is None else records, args.json)
    return 0


def summary(records: list[dict], rates: "Throughput") -> str:
    """One line of figures over every prompt."""
    tokens, t = sum(len(r["token_ids"]) for r in records), totals(records)
    hits, misses = t["expert_hits"], t["expert_misses"]
    rate = f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "n/a"
    return (f"{tokens} tokens, TTFT {t['ttft_ms']:.1f} ms, TPOT {t['tpot_ms']:.1f} ms, {rates}, expert hit rate "
            f"{rate}, read {format_bytes(t['bytes_read']['disk'])} from disk, {format_bytes(t['bytes_read']['host'])} "
            "from host")


def totals(records: list[dict]) -> dict:
    """Over the records of prompts: mean TTFT and TPOT, expert hits and misses, bytes read per tier."""
    return {"ttft_ms": fmean(r["ttft_ms"] for r in records), "tpot_ms": fmean(r["tpot_ms"] for r in records),
            **{name: sum(r[name] for r in records) for name in ("expert_hits", "expert_misses")},
            "bytes_read": {tier: sum(r["bytes_read"].get(tier, 0) for r in records) for tier in ("disk", "host")}}


@dataclass
class Throughput:
    """Prompt and generation tokens per second over a run's batches, as llama.cpp reports them."""

    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    decode_tokens: int = 0  # generated tokens after each row's first (which the prefill produces)
    decode_ms: float = 0.0

    def add(self, result) -> None:
        m, steps = result.metrics, max(len(ids) for ids in result.token_ids)
        self.prompt_tokens += m.num_prompt_tokens
        self.prefill_ms += m.ttft_ms
        self.decode_tokens += m.num_generated_tokens - len(result.token_ids)
        self.decode_ms += m.tpot_ms * max(0, steps - 1)

    @property
    def prompt_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_ms * 1e3 if self.prefill_ms else 0.0

    @property
    def generation_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_ms * 1e3 if self.decode_ms else None

    def __str__(self) -> str:
        decode = "n/a" if self.generation_per_s is None else f"{self.generation_per_s:.2f}"
        return f"prompt {self.prompt_per_s:.1f} tokens/s, generation {decode} tokens/s"


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


def _generate(args, prompts: list[str]) -> tuple[list[dict], Throughput]:
    """Runs the prompts in batches: one JSON record per prompt, and the run's throughput."""
    from moestream.parallel.launch import open_engine

    recording = args.record_trace is not None
    config = from_args(EngineConfig, args, publish_gate_probs=recording, publish_hidden=recording and args.record_hidden)
    records, rates = [], Throughput()
    with open_engine(args.model, config, args, progress=True, on_plan=print_lines) as engine:
        print(engine.threads, file=sys.stderr, flush=True)
        if engine.replay is not None:  # the trace fits the model: label what follows
            from moestream.runtime.replay import REPLAY_LABEL

            print(f"[{REPLAY_LABEL} from {args.replay_routing}: the text below is for measurement only]", flush=True)
        recorder = _recorder(engine, args) if recording else None
        for start in range(0, len(prompts), args.batch_size):
            records += _batch(engine, args, prompts, start, rates, recorder)
        if recorder is not None:
            from moestream.trace.format import save_trace

            save_trace(recorder.to_trace(), args.record_trace)
    return records, rates


def _batch(engine, args, prompts: list[str], start: int, rates: "Throughput", recorder) -> list[dict]:
    """Generates the batch of prompts from `start`: one JSON record per prompt (its text to the recorder)."""
    from moestream.parallel.launch import expert_parallel_report

    batch, many = prompts[start: start + args.batch_size], args.prompts_file is not None
    if many:
        print(f"--- prompt {start + 1}/{len(prompts)} ---", flush=True)
    result = _run_batch(engine, batch, args.max_new_tokens)
    rates.add(result)
    parallel = expert_parallel_report(engine)  # every rank's figures of the batch, under torchrun
    records = []
    for row, prompt in enumerate(batch):
        if recorder is not None:
            recorder.set_text(result.seq_ids[row], prompt)
        extra = {"prompt": prompt, "batch": start // args.batch_size} if many else {}
        records.append(report(result, row) | extra | ({"expert_parallel": parallel} if parallel else {}))
    return records


def print_lines(lines: list[str]) -> None:
    print("\n".join(lines), file=sys.stderr, flush=True)


def _run_batch(engine, batch: list[str], max_new_tokens: int):
    """Generates; one prompt's text is streamed to stdout as produced, a batch's printed at the end."""
    if len(batch) > 1:
        result = engine.generate(batch, max_new_tokens=max_new_tokens)
        print("\n".join(f"[{row + 1}] {text}" for row, text in enumerate(result.texts)), flush=True)
        return result
    from transformers import TextStreamer

    streamer, streamed = TextStreamer(engine.tokenizer, skip_special_tokens=True), []

    def stream(new) -> None:
        import torch

        streamed.append(len(new))
        streamer.put(torch.tensor([t for t in new if t is not None], dtype=torch.long))

    try:
        return engine.generate(batch, max_new_tokens=max_new_tokens, on_tokens=stream)
    finally:
        if streamed:  # prints the words held back, also on Ctrl-C (and no blank line before an error)
            streamer.end()


def report(result, row: int) -> dict:
    """The JSON record of one prompt of a generation result."""
    m = result.metrics
    return {"text": result.texts[row], "token_ids": result.token_ids[row], "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
            "expert_hits": m.expert_hits, "expert_misses": m.expert_misses, "bytes_read": dict(m.bytes_read),
            "replayed": result.replayed, "stall_ms": m.stall_ms, "transfer_ms": m.transfer_ms}


def _recorder(engine, args):
    from moestream.trace.recorder import TraceRecorder

    if not engine.records_traces:
        family = engine.checkpoint.adapter.model_type
        raise MoestreamError(f"--record-trace needs a decoder-only model; {family} routes its encoder "
                             "and decoder tokens apart")
    # with --record-hidden, a recorder that also asks the engine for each token's input embedding
    kind = type("InputsRecorder", (TraceRecorder,), {"needs_embeddings": True}) if args.record_hidden else TraceRecorder
    recorder = kind(engine.checkpoint.topology, source=f"moestream generate {args.model}")
    engine.add_observer(recorder)
    return recorder
