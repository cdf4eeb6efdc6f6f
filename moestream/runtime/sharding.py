"""What the engine asks of expert parallelism (moestream.parallel), as protocols: which experts this
rank owns and how a layer's rows are combined (`Shard`), and who hears of each step on the rank that
schedules (`StepAnnouncer`). Knows no process group, placement or transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from moestream.topology import ExpertKey

if TYPE_CHECKING:
    from moestream.runtime.scheduling.scheduler import ScheduledBatch


class Shard(Protocol):
    """The experts one rank owns among several (moestream.parallel.shard.ExpertShard)."""

    def owns(self, key: ExpertKey) -> bool: ...

    def owned_rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """ids [S] expert ids of a layer's (token, k) rows -> [S] bool: owned here."""

    def combine(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """[S, H] this rank's rows (the others zero) -> [S, H] every rank's rows."""


class StepAnnouncer(Protocol):
    """Tells the other ranks what this one runs (moestream.parallel.steps.Leader)."""

    def announce(self, batch: "ScheduledBatch", replay_paused: bool) -> None:
        """Before the batch's forward pass."""

    def ended(self, seq_id: int) -> None:
        """A sequence ended (its state in the policy too)."""

    def reset_stats(self) -> None:
        """The store's figures start again from zero."""

    def idle(self) -> None:
        """No step is running now (a server without requests calls this often)."""


class Alone:
    """The announcer of an engine that runs on one rank: there is no one to tell."""

    def announce(self, batch: "ScheduledBatch", replay_paused: bool) -> None:
        pass

    def ended(self, seq_id: int) -> None:
        pass

    def reset_stats(self) -> None:
        pass

    def idle(self) -> None:
        pass


ALONE = Alone()  # stateless, shared
