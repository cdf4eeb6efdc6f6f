"""A caller's hold on experts it fetched: it hands them out as their bytes are in place, then releases them.

The store decides which candidate is ready (`next_ready`); the Fetch keeps the order and releases the
pins once. Call `ready` and `release` on the thread whose stream runs the kernels that read the slots:
each slot is handed out once that stream waits for its copy, and `release` records those kernels as the
slots' last readers. It knows no tier, queue or policy.
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
        """landed: each key's (key, slot, arrival event or None) where all had landed (no call on the store)."""
        self.keys, self._store, self._landed, self._released = keys, store, landed, False

    def ready(self, reorder: bool = True) -> Iterator[tuple[ExpertKey, torch.Tensor]]:
        """(key, slot) for every key, the first in place when reorder; the stream waits for the slot's copy."""
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
