"""A CPU stand-in for the CUDA copy link whose copies complete later than they are issued.

`CpuLink` copies at once and returns an event that is already done, so on the CPU nothing checks
that the stores wait for a copy before its destination is read, or before its source is written
again. `LateLink` runs its copies in the order issued, as a CUDA copy stream does, but only when
they must have run: when the host waits for an event of it or of a later copy (`synchronize`), or
when the whole link is synchronised. A copy reads its source when it runs, not when it is issued,
so a store that overwrites a source too early copies the wrong bytes. The compute stream is the
test: `wait_on_compute` only records that compute's later work waits for the copy, and `compute()`
runs what compute has been told to wait for, as the stream would before the test's next kernel;
a copy that nothing waits for does not run, so a store that hands out a slot without making
compute wait shows stale bytes. With `credits`, copies run only as the test allows (`allow`), so
that a test can hold copies in flight. `compute_event` hands out a new `ComputeMark` each call (compute
on the CPU is done when it returns), and each copy records the mark it was told to follow (`afters`).
"""

import threading
import time
from collections import deque

import torch

from moestream.store.streams import Event, Link

WAIT_S = 10.0  # how long a wait for a copy that the test does not allow lasts before it fails


class LateEvent(Event):
    def __init__(self, link: "LateLink"):
        self.link, self.ran = link, False

    def done(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self.link.run_until(self)

    def wait_on_compute(self) -> None:
        self.link.compute_waits_for(self)


class ComputeMark(Event):
    """How far compute had been issued when the store asked (`compute_event`); numbered in order."""

    def __init__(self, number: int):
        self.number = number

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Done."""

    def wait_on_compute(self) -> None:
        """Done."""

    def __repr__(self) -> str:
        return f"ComputeMark({self.number})"


class LateLink(Link):
    def __init__(self, credits: int | None = None):
        super().__init__(torch.device("cpu"))
        self.credits = credits  # copies the test allows to run (None: any)
        self.issued: list[int] = []  # destination address of each copy, in the order issued
        self.ran: list[int] = []  # the same, in the order run
        self.afters: list[Event | None] = []  # the event each copy was told to follow, in the order issued
        self.marks: list[ComputeMark] = []  # compute_event's, in order
        self._pending: deque[tuple[torch.Tensor, torch.Tensor, LateEvent]] = deque()
        self._compute_waits: list[LateEvent] = []  # events the compute stream waits for before its next work
        self._cond = threading.Condition()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> LateEvent:
        event = LateEvent(self)
        with self._cond:
            self._pending.append((dst, src, event))
            self.issued.append(dst.data_ptr())
            self.afters.append(after)
        return event

    def compute_event(self) -> ComputeMark:
        with self._cond:
            self.marks.append(ComputeMark(len(self.marks)))
            return self.marks[-1]

    def pending_sources(self) -> list[tuple[int, int]]:
        """(address, bytes) of the source of every copy issued that has not run yet."""
        with self._cond:
            return [(src.data_ptr(), src.numel()) for _, src, _ in self._pending]

    def allow(self, num_copies: int) -> None:
        with self._cond:
            self.credits += num_copies
            self._cond.notify_all()

    def run_until(self, event: LateEvent) -> None:
        """Runs the copies issued up to event's, in order, as far as the credits allow."""
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not event.ran:
                if self.credits == 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("a copy was waited on that the test never allowed to run")
                    self._cond.wait(left)
                    continue
                dst, src, done = self._pending.popleft()
                dst.numpy()[:] = src.numpy()
                self.ran.append(dst.data_ptr())
                done.ran = True
                if self.credits is not None:
                    self.credits -= 1

    def compute_waits_for(self, event: LateEvent) -> None:
        with self._cond:
            self._compute_waits.append(event)

    def compute(self) -> None:
        """The compute stream's next work begins: every copy it waits for has run by then."""
        with self._cond:
            waits, self._compute_waits = self._compute_waits, []
        for event in waits:
            event.synchronize()

    def synchronize(self) -> None:
        with self._cond:
            last = self._pending[-1][2] if self._pending else None
        if last is not None:
            last.synchronize()
