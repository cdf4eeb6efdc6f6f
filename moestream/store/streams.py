"""Copy links between tiers and the events that mark their copies done, behind one small interface.

A `Link` copies one slot's bytes into a slot of another tier and returns an `Event`. The CPU link copies
at once (numpy: no intra-op threads) and its events are done. The CUDA link issues `copy_(non_blocking=True)`
on its own stream after the destination's last reader (`after`) and returns an event that the compute
stream waits on (`wait_on_compute`), the host only before it overwrites the source (`synchronize`);
nothing synchronises the whole device. A link knows no experts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moestream.registry import Registry

LINKS: Registry[Link] = Registry("copy link")


class Event(ABC):
    """The completion of one copy."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the copy has completed."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the copy has completed."""

    @abstractmethod
    def wait_on_compute(self) -> None:
        """Order the compute stream's later work after the copy (the host does not block)."""


class Link(ABC):
    """One copy link into a tier on `device`; its copies run in the order issued (a CUDA stream's order)."""

    def __init__(self, device: torch.device):
        self.device = device

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        """dst <- src (equal 1-D uint8 slots), after `after` (dst's last reader, a `compute_event`) if given."""

    @abstractmethod
    def compute_event(self) -> Event:
        """An event of the calling thread's compute stream: the work issued on it so far."""

    def synchronize(self) -> None:
        """Block until every copy issued on this link has completed."""


class DoneEvent(Event):
    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Already done."""

    def wait_on_compute(self) -> None:
        """Already done."""


DONE = DoneEvent()  # an event of work already done (it holds no state)


@LINKS.register("cpu")
class CpuLink(Link):
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        if after is not None:
            after.synchronize()
        dst.numpy()[:] = src.numpy()
        return DONE

    def compute_event(self) -> Event:
        return DONE  # CPU compute has run by the time the caller asks


class CudaEvent(Event):
    def __init__(self, event: "torch.cuda.Event", device: torch.device):
        self.event, self.device = event, device

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def wait_on_compute(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


@LINKS.register("cuda")
class CudaLink(Link):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after.event)  # a CudaEvent: this link's compute_event
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaEvent(event, self.device)

    def compute_event(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CudaEvent(event, self.device)

    def synchronize(self) -> None:
        self.stream.synchronize()


def make_link(device: str | torch.device) -> Link:
    """The copy link into a tier on this device (by its type in LINKS)."""
    device = torch.device(device)
    return LINKS.create(device.type, device)
