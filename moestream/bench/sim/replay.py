"""Turns a trace into the event sequence the engine would publish, for the simulator, the benches and
predictors' tests: a decode stream (one iteration per token, sequences back to back), prefill (one per
prompt), or batched decode (B sequences interleaved, one token of each per iteration)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from moestream.events import IterationContext, RoutingEvent
from moestream.trace.replay import Iteration, batched_rows
from moestream.trace.schema import Trace


def iteration(trace: Trace, rows: np.ndarray, step: int, finished: tuple[int, ...] = ()) -> Iteration:
    seq_ids, positions = trace.seq_ids[rows], trace.positions[rows]
    ctx = IterationContext(step=step, seq_ids=seq_ids, positions=positions,
                           is_prefill=bool(trace.is_prefill[rows].all()) and len(rows) > 1,
                           token_ids=None if trace.token_ids is None else trace.token_ids[rows],
                           tokens=None if trace.tokens is None else tuple(trace.tokens[i] for i in rows),
                           embeddings=None if trace.embeddings is None else trace.embeddings[rows].astype(np.float32))
    experts = _by_layer(trace.experts, rows, np.int64)  # [L, T, K]
    weights, probs, hidden = (_by_layer(v, rows, np.float32) for v in (trace.gate_weights, trace.gate_probs, trace.hidden))
    events = tuple(RoutingEvent(layer=layer, expert_ids=experts[layer], seq_ids=seq_ids, positions=positions,
                                gate_weights=None if weights is None else weights[layer],
                                gate_probs=None if probs is None else probs[layer],
                                hidden=None if hidden is None else hidden[layer])
                   for layer in range(trace.topology.num_layers))
    return Iteration(ctx, rows, events, finished)


def _by_layer(values: np.ndarray | None, rows: np.ndarray, dtype) -> np.ndarray | None:
    """values[rows] ([T, L, ...]) laid out layer-major ([L, T, ...], contiguous per layer), or None."""
    return None if values is None else np.ascontiguousarray(values[rows].swapaxes(0, 1), dtype=dtype)


def decode_stream(trace: Trace) -> Iterator[Iteration]:
    """Every token is one iteration; sequences follow one another."""
    rows = ((seq, row, end) for seq, start, end in trace.sequence_bounds() for row in range(start, end))
    for step, (seq, row, end) in enumerate(rows):
        yield iteration(trace, np.array([row]), step, (seq,) if row == end - 1 else ())


def prefill(trace: Trace) -> Iterator[Iteration]:
    """Every sequence's tokens form one iteration."""
    for step, (seq, start, end) in enumerate(trace.sequence_bounds()):
        yield iteration(trace, np.arange(start, end), step, (seq,))


def batched_decode(trace: Trace, batch_size: int) -> Iterator[Iteration]:
    """B sequences in flight; each iteration takes the next token of each; a finished one is replaced."""
    for step, (rows, finished) in enumerate(batched_rows(trace, batch_size)):
        yield iteration(trace, rows, step, finished)


def head_tokens(trace: Trace, num_tokens: int) -> Trace:
    """The first whole sequences of trace holding at least num_tokens tokens (all, if fewer)."""
    ends = np.array([end for _, _, end in trace.sequence_bounds()])
    if not len(ends) or ends[-1] <= num_tokens:
        return trace
    return trace.take(np.arange(ends[int(np.searchsorted(ends, num_tokens))]))
