"""The offloaded inference runtime: loads a checkpoint's dense part, serves experts from the store,
publishes routing events, schedules sequences and runs generation. It knows no policy or family by name.

`Engine` and its results are imported on first use, so that a torch-free module of the runtime (the
token schedulers, which the settings name) imports without torch."""

from moestream.config import EngineConfig

_LAZY = {"Engine": "moestream.runtime.engine", "GenerationResult": "moestream.runtime.engine",
         "GenerationMetrics": "moestream.runtime.metrics"}

__all__ = ["Engine", "EngineConfig", "GenerationMetrics", "GenerationResult"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moestream.runtime' has no attribute {name!r}")
