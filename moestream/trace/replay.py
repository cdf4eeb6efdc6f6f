"""One iteration of a replayed trace (`Iteration`: what the policy driver replays) and the order in which
batched decode interleaves sequences (`batched_rows`); the replays themselves are the lab's
(`moestream.bench.sim.replay`)."""

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


def batched_rows(trace: Trace, batch_size: int) -> Iterator[tuple[np.ndarray, tuple[int, ...]]]:
    """The rows of each batched-decode iteration and the sequences it finishes, without events."""
    pending = list(trace.sequence_bounds())[::-1]
    active: list[list[int]] = []  # [seq, next row, end row]
    while pending or active:
        while pending and len(active) < batch_size:
            active.append(list(pending.pop()))
        rows = np.array([slot[1] for slot in active])
        for slot in active:
            slot[1] += 1
        finished = tuple(slot[0] for slot in active if slot[1] == slot[2])
        active = [slot for slot in active if slot[1] < slot[2]]
        yield rows, finished
