"""A follower rank's copies of the KV caches that rank 0's batching rule holds.

Rank 0 numbers each batch cache on its first step (`StepMessage.cache_id`); a follower keeps each number's cache
with its sequences. A new prefill starts an empty one; a new decode batch is merged from its sequences' own caches,
each cut out of the cache that held it (the same tensors as rank 0's cut: a cache is not written between its last
step and its cut); a cache whose sequences all ended is dropped. Knows no scheduler, rule or model."""

from __future__ import annotations

from dataclasses import dataclass

from moestream.runtime import kv
from moestream.runtime.runner import BatchCache


@dataclass
class Held:
    seq_ids: tuple[int, ...]  # its rows
    cache: BatchCache
    alive: set[int]  # its sequences not ended


class CacheMirror:
    def __init__(self, device: str):
        self.device = device
        self.held: dict[int, Held] = {}  # by rank 0's number
        self.own: dict[int, kv.SeqCache] = {}  # by seq id: cut out of a held cache

    def cache(self, message, seq_ids: list[int]) -> BatchCache:
        """The cache the announced step runs over."""
        if message.cache_id not in self.held:
            self.held[message.cache_id] = Held(tuple(seq_ids), self._new(message, seq_ids), set(seq_ids))
        return self.held[message.cache_id].cache

    def ended(self, seq_id: int) -> None:
        self.own.pop(seq_id, None)
        for number, held in list(self.held.items()):
            held.alive.discard(seq_id)
            if not held.alive:
                del self.held[number]

    def _new(self, message, seq_ids: list[int]) -> BatchCache:
        if message.is_prefill:
            return BatchCache(kv.empty_cache() if message.empty_kv else None)
        for seq_id in seq_ids:
            if seq_id not in self.own:  # cut the cache holding it into its live sequences' own caches
                held = self.held.pop(next(n for n, h in self.held.items() if seq_id in h.seq_ids))
                for row_id, cut in zip(held.seq_ids, kv.split(held.cache.kv, held.cache.mask.sum(-1).tolist())):
                    if row_id in held.alive:
                        self.own[row_id] = cut
        cache, mask = kv.merge([self.own.pop(seq_id) for seq_id in seq_ids])
        return BatchCache(cache, mask.to(self.device))
