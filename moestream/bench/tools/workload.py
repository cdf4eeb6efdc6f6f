"""Workloads to replay against a server: arrival traces (Azure LLM inference CSV, Mooncake JSONL)
read from where the user keeps them, rescaled to a request rate and a model's lengths, with prompt
text drawn from a real prompt set. Readers register by file format; nothing here sends a request.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Callable

from moestream.errors import MoestreamError
from moestream.registry import Registry

log = logging.getLogger(__name__)

NAMED_TRACES = {  # trace name -> file under <data dir>/workloads
    "azure-conv": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
    "mooncake": "mooncake/conversation_trace.jsonl",
}
SHAREGPT = "sharegpt/ShareGPT_V3_filtered_1000.json"
WORDS_PER_TOKEN = 0.75  # English text: about 3 words per 4 tokens


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # since the trace's first request
    num_input_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class PlannedRequest:
    send_at_s: float  # since the start of the run
    prompt: str
    max_tokens: int


TRACE_READERS: Registry[Callable[[Path], list[TraceRequest]]] = Registry("trace format")  # by file suffix


@TRACE_READERS.register(".csv")
def read_azure_csv(path: Path) -> list[TraceRequest]:
    """TIMESTAMP (e.g. 2023-11-16 18:15:46.6805900), ContextTokens, GeneratedTokens."""
    with path.open(newline="") as handle:
        rows = [(_timestamp(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(handle)]
    start = min((t for t, _, _ in rows), default=0.0)
    return [TraceRequest(t - start, i, o) for t, i, o in rows]


@TRACE_READERS.register(".jsonl")
def read_mooncake(path: Path) -> list[TraceRequest]:
    """One JSON object a line: timestamp (ms), input_length, output_length."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    start = min((r["timestamp"] for r in rows), default=0)
    return [TraceRequest((r["timestamp"] - start) / 1e3, int(r["input_length"]), int(r["output_length"]))
            for r in rows]


def _timestamp(text: str) -> float:
    date, _, fraction = text.partition(".")
    return datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{fraction or 0}")


def trace_path(trace: str, data_dir: Path) -> Path:
    """A named trace under data_dir/workloads, or the path itself."""
    path = data_dir / "workloads" / NAMED_TRACES[trace] if trace in NAMED_TRACES else Path(trace)
    if not path.is_file():
        raise MoestreamError(f"trace file {path} does not exist (named traces: {', '.join(NAMED_TRACES)}; "
                             "give --data-dir or a path)")
    return path


def read_trace(path: Path) -> list[TraceRequest]:
    try:
        requests = sorted(TRACE_READERS.get(path.suffix)(path), key=lambda r: r.arrival_s)
    except (KeyError, ValueError, OSError) as error:
        raise MoestreamError(f"cannot read trace {path}: {error}") from None
    if not requests:
        raise MoestreamError(f"trace {path} has no requests")
    return requests


def prompt_texts(data_dir: Path) -> list[str]:
    """ShareGPT's first turns when data_dir has them, else the packaged English and code text."""
    path = data_dir / "workloads" / SHAREGPT
    if path.is_file():
        return [c["conversations"][0]["value"] for c in json.loads(path.read_text()) if c["conversations"]]
    log.warning("no prompt set at %s: prompts are cut from the packaged tokenizer corpus", path)
    text = (resources.files("moestream") / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


def plan(trace: list[TraceRequest], prompts: list[str], rps: float, duration_s: float,
         scale_lengths: float, max_requests: int) -> list[PlannedRequest]:
    """The trace's first rps * duration_s requests (at most max_requests), their gaps stretched so
    that they arrive at rps on average (the bursts within them kept); lengths scaled by
    scale_lengths (at least one token); prompt i cut or repeated to its input length."""
    window = trace[: max(1, min(max_requests, round(rps * duration_s)))]
    span = window[-1].arrival_s - window[0].arrival_s
    stretch = (len(window) - 1) / (span * rps) if span > 0 else 0.0
    planned = []
    for index, request in enumerate(window):
        send_at = (request.arrival_s - window[0].arrival_s) * stretch if stretch else index / rps
        words = max(1, round(request.num_input_tokens * scale_lengths * WORDS_PER_TOKEN))
        planned.append(PlannedRequest(send_at, _prompt(prompts[index % len(prompts)], words),
                                      max(1, round(request.num_output_tokens * scale_lengths))))
    return planned


def _prompt(text: str, num_words: int) -> str:
    words = text.split() or ["hello"]
    return " ".join((words * (num_words // len(words) + 1))[:num_words])
