"""Publishes what the runtime sees to its observers: iteration contexts, routing events, sequence ends.

The engine tells the publisher which sequence and position each row of the next forward pass belongs
to (`RowContext`); the experts forward hands it each layer's routing, already on the host, and it builds
a `RoutingEvent` of the rows that really run. It knows no policy: events go to a `PolicyDriver`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moestream.contracts import Observer
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.driver import PolicyDriver


@dataclass(frozen=True)
class RowContext:
    """The rows of one forward pass (batch-major, as the model flattens them)."""

    seq_ids: np.ndarray  # [T] int
    positions: np.ndarray  # [T] int
    active: np.ndarray  # [T] bool: rows whose experts run (not padding, not a finished sequence)

    def __post_init__(self):
        if not len(self.seq_ids) == len(self.positions) == len(self.active):
            raise ValueError("seq_ids, positions and active must have one entry per row")

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    @classmethod
    def single(cls, num_rows: int) -> "RowContext":
        return cls(np.zeros(num_rows, np.int64), np.arange(num_rows), np.ones(num_rows, bool))


@dataclass(frozen=True)
class Routing:
    """One layer's routing on the host (every row of the layer)."""

    expert_ids: np.ndarray  # [T, K] int64
    weights: np.ndarray  # [T, K] float32
    hidden: np.ndarray | None = None  # [T, H] float32, where an observer needs router inputs
    probs: np.ndarray | None = None  # [T, E] float32: the router's full distribution, where it was tapped


class Publisher:
    def __init__(self, driver: PolicyDriver | None = None, always_hidden: bool = False):
        self.driver = driver  # None: nobody observes (a forward outside the engine)
        self.always_hidden = always_hidden
        self._rows: RowContext | None = None
        self._observed: bool | None = None

    @property
    def observers(self) -> Sequence[Observer]:
        return () if self.driver is None else self.driver.observers

    @property
    def observed(self) -> bool:
        """Whether some observer reads routing events (`Observer.observe` overridden); asked again each iteration."""
        if self._observed is None:
            self._observed = any(map(_observes, self.observers))
        return self._observed

    @property
    def needs_hidden(self) -> bool:
        return self.always_hidden or any(getattr(o, "needs_hidden", False) for o in self.observers)

    @property
    def needs_embeddings(self) -> bool:
        return any(getattr(o, "needs_embeddings", False) for o in self.observers)

    def set_rows(self, rows: RowContext | None) -> None:
        self._rows = rows

    def rows(self, num_rows: int) -> RowContext:
        if self._rows is None:
            return RowContext.single(num_rows)
        if self._rows.num_rows != num_rows:
            raise RuntimeError(f"the engine announced {self._rows.num_rows} rows but a layer got {num_rows}")
        return self._rows

    def begin_iteration(self, ctx: IterationContext) -> None:
        self._observed = None  # observers may have come or gone since the last iteration
        if self.driver is not None:
            self.driver.begin_iteration(ctx)

    def end_sequence(self, seq_id: int) -> None:
        if self.driver is not None:
            self.driver.end_sequence(seq_id)

    def publish(self, layer: int, routing: Routing, rows: RowContext, active: np.ndarray) -> RoutingEvent:
        event = RoutingEvent(
            layer=layer,
            expert_ids=routing.expert_ids[active].astype(np.int64),  # [R, K]
            seq_ids=rows.seq_ids[active],
            positions=rows.positions[active],
            gate_weights=routing.weights[active],
            gate_probs=None if routing.probs is None else routing.probs[active],
            hidden=None if routing.hidden is None else routing.hidden[active],
        )
        if self.driver is not None:
            self.driver.observe(event)
        return event


def _observes(observer) -> bool:
    """Whether an observer overrides `Observer.observe` (which ignores routing events)."""
    return getattr(observer.observe, "__func__", None) is not Observer.observe
