"""The simulator's executor: the store's links run in virtual time, each round as long as a cost says.

The store's mechanism (`moestream.store.chain`: its queues, links, host tier, `defer`, promotion and
rounds) runs unchanged; where the engine's executors move bytes on threads (`moestream.store.executor`),
this one keeps a clock. A free link takes its next round at once (up to `max_chunks` speculative chunks,
or every queued demand transfer whole, as `TransferLink.take` decides); the round lasts `round_ms(lane,
held)` and finishes at its end, rounds of different links in time order (a tie: the chain's order). A
wait runs rounds until what it waits for holds, moving the clock; an impatient one returns at once, as
the threaded executor's does. `sync`: as the inline executor (`--sync`), every round is whole, a call
returns once no link has work and every wait runs rounds. Slots are handles (`VirtualSlots`): nothing is
read or written. Knows no policy, no cost model and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moestream.store.executor import Executor, Window
from moestream.store.transfer import Held, TransferError, label
from moestream.tracer import Label

RoundMs = Callable[[str, Held], float]  # a round's duration on a lane


@dataclass(frozen=True)
class VirtualSegment:
    """An expert's bytes in virtual time, in no file: what `transfer.pieces` cuts into a transfer's chunks."""

    nbytes: int
    file: str = ""
    offset: int = 0


class VirtualSlots:
    """A tier's slots in virtual time: a slot is its number; no bytes, no event to wait for."""

    def slot(self, index: int, residue: int = 0) -> int:
        return index

    def last_read(self, index: int) -> None:
        return None

    def written(self, index: int) -> None:
        return None

    def mark_written(self, index: int, event) -> None:
        pass

    def mark_read(self, index: int, event) -> None:
        pass


class Alone:
    """The condition of a chain that nothing runs beside: there is no lock to hold and no one to wake."""

    def notify_all(self) -> None:
        pass


class VirtualExecutor(Executor):
    """The links' rounds on a virtual clock (see the module doc)."""

    def __init__(self, max_chunks: int, round_ms: RoundMs, on_round: Callable[[str, Held, bool], None] | None = None,
                 sync: bool = False):
        """round_ms: a round's duration; on_round(lane, held, finished): told of each round as it starts, and
        as it finishes, before the link is; sync: the inline executor's rules (the module doc)."""
        self.max_chunks = None if sync else max_chunks
        self.round_ms, self.on_round, self.sync = round_ms, on_round, sync
        self.now_ms = 0.0
        self._rounds: dict[str, tuple[Held, float, float]] = {}  # lane -> the round it moves: (held, start, end)

    def queued(self, label: Label) -> None:
        self._start_free()
        while self.sync and self.step():
            pass

    def wait(self, ready: Callable[[], bool], what: str, patient: bool = True) -> bool:
        while not ready():
            if not (patient or self.sync):
                return False
            self._start_free()  # what the caller queued since its last call
            if not self.step():
                raise TransferError(f"nothing left to move while waiting for {what}")
        return True

    def stall_s(self, window: Window) -> float:
        return 0.0  # the simulator times its own stalls

    def step(self) -> bool:
        """Finishes the round that ends first, the clock at its end, and starts the free links' next
        rounds; False where no round is under way."""
        if not self._rounds:
            return False
        link = min((link for link in self.links if link.lane in self._rounds),
                   key=lambda link: self._rounds[link.lane][2])
        held, start_ms, end_ms = self._rounds.pop(link.lane)
        self.now_ms = max(self.now_ms, end_ms)
        if self.on_round is not None:
            self.on_round(link.lane, held, True)
        seconds = self.tracer.add(link.lane, lambda: label(held), start_ms / 1e3, end_ms / 1e3)
        link.finish(held, link.move(held), seconds)
        self._start_free()
        return True

    def advance(self, until_ms: float) -> None:
        """Runs every round that ends by until_ms; the clock is then until_ms (or later, never earlier)."""
        while self._rounds and min(end for _, _, end in self._rounds.values()) <= until_ms:
            self.step()
        self.now_ms = max(self.now_ms, until_ms)

    def _start_free(self) -> None:
        """Each free link takes its next round; in sync, one round at a time, the last link's first (as the
        inline executor runs them: its rounds free the host slots the first one fills)."""
        if self.sync and self._rounds:
            return
        for link in reversed(self.links) if self.sync else self.links:
            if link.lane not in self._rounds:
                held = link.take(self.max_chunks)
                if held:
                    self._rounds[link.lane] = (held, self.now_ms, self.now_ms + self.round_ms(link.lane, held))
                    if self.on_round is not None:
                        self.on_round(link.lane, held, False)
                    if self.sync:
                        return
