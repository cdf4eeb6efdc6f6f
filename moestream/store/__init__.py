"""Expert tiers: disk reader, host and device slot pools, budgets, and the store that moves experts.

The names below are imported when first used, so that the mechanism (`chain`, `transfer`, `executor`)
imports without torch (the simulator runs it)."""

import importlib

_EXPORTS = {"Budget": "config", "StoreConfig": "config", "DiskReader": "disk", "InlineExecutor": "executor",
            "ThreadedExecutor": "executor", "SlotPool": "pool", "ExpertStore": "store", "StoreStats": "stats"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
