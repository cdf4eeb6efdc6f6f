"""The offloaded inference runtime: loads a checkpoint's dense part, serves experts from the store,
publishes routing events and runs greedy generation. It knows no policy or family by name."""

from moestream.config import EngineConfig
from moestream.runtime.engine import Engine, GenerationResult
from moestream.runtime.metrics import GenerationMetrics

__all__ = ["Engine", "EngineConfig", "GenerationMetrics", "GenerationResult"]
