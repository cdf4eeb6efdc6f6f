"""Turns a trace into the event sequence the engine would publish, for predictors and the simulator.

A decode stream is one iteration per token, sequences back to back; prefill is one iteration per
prompt; batched decode interleaves B sequences, one token of each per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from moestream.events import IterationContext, RoutingEvent
from moestream.trace.schema import Trace


@dataclass(frozen=True)
class Iteration:
    ctx: IterationContext
    rows: np.ndarray  # [T] trace rows of this iteration's tokens
    events: tuple[RoutingEvent, ...]  # one per MoE layer, in layer order
    finished: tuple[int, ...]  # sequences that end with this iteration


def iteration(trace: Trace, rows: np.ndarray, step: int, finished: tuple[int, ...] = ()) -> Iteration:
    seq_ids, positions = trace.seq_ids[rows], trace.positions[rows]
    ctx = IterationContext(
        step=step,
        seq_ids=seq_ids,
        positions=positions,
        is_prefill=bool(trace.is_prefill[rows].all()) and len(rows) > 1,
        token_ids=None if trace.token_ids is None else trace.token_ids[rows],
        tokens=None if trace.tokens is None else tuple(trace.tokens[i] for i in rows),
        embeddings=None if trace.embeddings is None else trace.embeddings[rows].astype(np.float32),
    )
    events = tuple(_event(trace, rows, layer, seq_ids, positions) for layer in range(trace.topology.num_layers))
    return Iteration(ctx, rows, events, finished)


def _event(trace: Trace, rows, layer: int, seq_ids, positions) -> RoutingEvent:
    def pick(values):
        return None if values is None else values[rows, layer].astype(np.float32)

    return RoutingEvent(
        layer=layer,
        expert_ids=trace.experts[rows, layer].astype(np.int64),  # [T, K]
        seq_ids=seq_ids,
        positions=positions,
        gate_weights=pick(trace.gate_weights),
        gate_probs=pick(trace.gate_probs),
        hidden=pick(trace.hidden),
    )


def decode_stream(trace: Trace) -> Iterator[Iteration]:
    """Every token is one iteration; sequences follow one another."""
    step = 0
    for seq, start, end in trace.sequence_bounds():
        for row in range(start, end):
            yield iteration(trace, np.array([row]), step, (seq,) if row == end - 1 else ())
            step += 1


def prefill(trace: Trace) -> Iterator[Iteration]:
    """Every sequence's tokens form one iteration."""
    for step, (seq, start, end) in enumerate(trace.sequence_bounds()):
        yield iteration(trace, np.arange(start, end), step, (seq,))


def batched_decode(trace: Trace, batch_size: int) -> Iterator[Iteration]:
    """B sequences in flight; each iteration takes the next token of each; a finished one is replaced."""
    pending = list(trace.sequence_bounds())[::-1]
    active: list[list[int]] = []  # [seq, next row, end row]
    step = 0
    while pending or active:
        while pending and len(active) < batch_size:
            seq, start, end = pending.pop()
            active.append([seq, start, end])
        rows = np.array([slot[1] for slot in active])
        for slot in active:
            slot[1] += 1
        finished = tuple(slot[0] for slot in active if slot[1] == slot[2])
        active = [slot for slot in active if slot[1] < slot[2]]
        yield iteration(trace, rows, step, finished)
        step += 1
