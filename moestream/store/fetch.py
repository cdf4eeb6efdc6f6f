"""A caller's hold on experts it fetched: it hands them out as their bytes are in place, then releases them.

The store decides which candidate is ready (`next_ready`); the Fetch keeps the order of the hand-out
and releases the pins once. Where every expert had landed when fetched, the store hands their slots over
with the Fetch, and it asks the store nothing more until release. Stream order: call `ready` and
`release` on the thread whose stream runs the kernels that read the slots. Each slot is handed out once that stream has been made to wait for
its copy (the host does not wait); `release`, once those kernels are issued, records them as the slots'
last readers, which a later copy into the slots waits for. It knows no tier, queue or policy.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import torch

from moestream.topology import ExpertKey


class FetchingStore(Protocol):
    def next_ready(self, candidates: Sequence[ExpertKey]) -> tuple[ExpertKey, torch.Tensor]: ...

    def release(self, keys: Sequence[ExpertKey]) -> None: ...


class Fetch:
    """Experts pinned for one computation, handed out resident first, then as they land; release() once."""

    def __init__(self, store: FetchingStore, keys: list[ExpertKey], landed: list[tuple] | None = None):
        """landed: every key's (key, slot, arrival event or None) where all had landed when fetched (the
        lean path: no further call on the store until release)."""
        self.keys = keys
        self._store = store
        self._landed = landed
        self._released = False

    def ready(self, reorder: bool = True) -> Iterator[tuple[ExpertKey, torch.Tensor]]:
        """(key, slot) for every key: the first in place when reorder, else in the order given; the current
        stream's later kernels run after the slot's copy."""
        if self._landed is not None:
            for key, slot, arrival in self._landed:
                if arrival is not None:
                    arrival.wait_on_compute()
                yield key, slot
            return
        remaining = list(self.keys)
        while remaining:
            key, slot = self._store.next_ready(remaining if reorder else remaining[:1])
            remaining.remove(key)
            yield key, slot

    def release(self) -> None:
        """Unpins the experts, after the kernels that read their slots are issued (on the current stream)."""
        if not self._released:
            self._released = True
            self._store.release(self.keys)

    def __enter__(self) -> "Fetch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
