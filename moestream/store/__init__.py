"""Expert tiers: disk reader, host and device slot pools, budgets, and the store that moves experts."""

from moestream.store.config import Budget, StoreConfig
from moestream.store.disk import DiskReader
from moestream.store.executor import InlineExecutor, ThreadedExecutor
from moestream.store.pool import SlotPool
from moestream.store.store import ExpertStore, StoreStats

__all__ = ["Budget", "DiskReader", "ExpertStore", "InlineExecutor", "SlotPool", "StoreConfig", "StoreStats",
           "ThreadedExecutor"]
