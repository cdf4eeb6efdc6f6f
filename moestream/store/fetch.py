"""A caller's hold on experts it fetched: it hands them out as their bytes are in place, then releases them.

The store decides which candidate is ready (`next_ready`); the Fetch keeps the order of the hand-out
and releases the pins once. It knows no tier, queue or policy.
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

    def __init__(self, store: FetchingStore, keys: list[ExpertKey]):
        self.keys = keys
        self._store = store
        self._released = False

    def ready(self, reorder: bool = True) -> Iterator[tuple[ExpertKey, torch.Tensor]]:
        """(key, slot) for every key: the first in place when reorder, else in the order given."""
        remaining = list(self.keys)
        while remaining:
            key, slot = self._store.next_ready(remaining if reorder else remaining[:1])
            remaining.remove(key)
            yield key, slot

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store.release(self.keys)

    def __enter__(self) -> "Fetch":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
