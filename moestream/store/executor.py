"""Where a store's link rounds run: on the caller's thread (`InlineExecutor`, `--sync`) or on one worker
thread per link beside compute (`ThreadedExecutor`); the simulator's: `moestream.bench.sim.clock`.

The executor runs the links' rounds (`TransferLink.take`, `move`, `finish`), times each on its link's
lane and says how long the caller stalled. Inline, every call returns with its transfers done: a wait
runs the next round instead of blocking, last link first (its rounds free the host slots the first one
fills), and the stall is the time of the rounds. Threaded, a wait blocks on the store's condition until
it holds or `transfer_timeout_s` has passed (an impatient one gives up at once); the stall is the waits.
Knows no tier, no expert and no policy.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

from moestream.store.transfer import DISK, H2D, Held, TransferError, TransferLink, label
from moestream.tracer import Label, LaneTotal, Tracer

if TYPE_CHECKING:
    from moestream.store.config import StoreConfig

IDLE_WAIT_S = 0.5  # how long an idle worker sleeps before it checks for stop again
STOP_TIMEOUT_S = 30.0  # close() waits this long for each worker to finish its round

Window = Callable[[str], LaneTotal]  # a lane's totals since the store's counters were reset


class Executor(ABC):
    def start(self, cond: threading.Condition, links: list[TransferLink], tracer: Tracer) -> None:
        """The store's condition (its lock guards the queues) and its links, in chain order."""
        self.cond, self.links, self.tracer = cond, links, tracer

    @abstractmethod
    def queued(self, label: Label) -> None:
        """Under the lock, at the end of a call that queued transfers (label: what the caller waits for)."""

    @abstractmethod
    def wait(self, ready: Callable[[], bool], what: str, patient: bool = True) -> bool:
        """Under the lock: returns once ready() holds (True), or False where it does not and the caller is
        not patient; raises TransferError where it never will (what: the words for the error)."""

    @abstractmethod
    def stall_s(self, window: Window) -> float:
        """The seconds the caller stalled for expert bytes, from the tracer's lanes."""

    def stop(self) -> None:
        """Stops whatever runs rounds beside the caller (outside the lock)."""

    def _traced(self, link: TransferLink, held: Held, began: float) -> float:  # the round's span; its seconds
        return self.tracer.add(link.lane, lambda: label(held), began, time.perf_counter())

    @property
    def num_threads(self) -> int:  # the threads it runs beside the caller (compute leaves a core each)
        return 0


class InlineExecutor(Executor):
    """Every round on the caller's thread, before the call returns (see the module doc)."""

    def queued(self, label: Label) -> None:
        self._run_until(lambda: not any(len(link.queue) for link in self.links), "the links to empty", label)

    def wait(self, ready: Callable[[], bool], what: str, patient: bool = True) -> bool:
        return self._run_until(ready, what, what)

    def _run_until(self, ready: Callable[[], bool], what: str, label: Label) -> bool:
        """Runs rounds until ready() holds, the caller waiting meanwhile (traced on the "wait" lane)."""
        if ready():
            return True
        with self.tracer.span("wait", label):
            while not ready():
                if not self._round():
                    raise TransferError(f"nothing left to move while waiting for {what}")
        return True

    def stall_s(self, window: Window) -> float:
        return window(DISK).seconds + window(H2D).seconds  # the caller moved the bytes itself

    def _round(self) -> bool:
        """One round of the last link with work (False: none has any)."""
        for link in reversed(self.links):
            held = link.take(None)
            if held:
                began = time.perf_counter()
                try:
                    errors = link.move(held)
                except BaseException as error:  # e.g. Ctrl-C: the round's transfers fail, then it goes on up
                    link.finish(held, {transfer: error for transfer, _ in held}, self._traced(link, held, began))
                    raise
                link.finish(held, errors, self._traced(link, held, began))
                return True
        return False


class ThreadedExecutor(Executor):
    """One worker thread per link, each running its link's rounds beside compute (see the module doc)."""

    def __init__(self, max_chunks: int, timeout_s: float):
        self.max_chunks, self.timeout_s, self._stopping = max_chunks, timeout_s, False
        self._threads: list[threading.Thread] = []

    def start(self, cond: threading.Condition, links: list[TransferLink], tracer: Tracer) -> None:
        super().start(cond, links, tracer)
        self._threads = [threading.Thread(target=self._run, args=(link,), name=f"moestream-{link.lane}-link",
                                          daemon=True) for link in links]
        for thread in self._threads:
            thread.start()

    def queued(self, label: Label) -> None:
        self.cond.notify_all()

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    def wait(self, ready: Callable[[], bool], what: str, patient: bool = True) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if not patient:
                return False
            if left <= 0:
                raise TransferError(f"timed out after {self.timeout_s:g} s waiting for {what}")
            self.cond.wait(left)
        return True

    def stall_s(self, window: Window) -> float:
        return window("wait").seconds

    def stop(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        for thread in reversed(self._threads):  # the host -> device link's first
            thread.join(STOP_TIMEOUT_S)
            if thread.is_alive():
                raise TransferError(f"the {thread.name} worker did not stop within {STOP_TIMEOUT_S:g} s")

    def _run(self, link: TransferLink) -> None:
        while True:
            with self.cond:
                held = self._take(link)
                if not held:
                    return
            began = time.perf_counter()
            errors = link.move(held)
            seconds = self._traced(link, held, began)
            with self.cond:
                link.finish(held, errors, seconds)
                self.cond.notify_all()

    def _take(self, link: TransferLink):
        """Under the lock: the link's next round, waiting for one; empty once stopping."""
        while not self._stopping:
            held = link.take(self.max_chunks)
            if held:
                return held
            self.cond.wait(IDLE_WAIT_S)
        return []


def executor_for(config: StoreConfig) -> Executor:
    """The executor config asks for: threaded when its transfers are asynchronous, else inline."""
    return ThreadedExecutor(config.chunks_in_flight, config.transfer_timeout_s) if config.asynchronous \
        else InlineExecutor()
