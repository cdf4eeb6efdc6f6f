"""The trace-driven simulator: the engine's mechanism in virtual time, cost models, metrics, protocols.

Importing the package registers its protocols (`stream`, `moe-beyond`) in `PROTOCOLS` and its offline bounds
(`belady`, `oracle`, `lookahead-N`, `default-lookahead-4`: policies that know the replay's future) in `POLICIES`.
"""

from moestream.bench.sim import bounds, engine, moe_beyond  # noqa: F401  (register the bounds and protocols)
from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.cost import PRESETS, CostModel, get_cost_model
from moestream.bench.sim.protocols import PROTOCOLS, SimulationError, simulate

__all__ = ["PRESETS", "PROTOCOLS", "CostModel", "SimConfig", "SimulationError", "get_cost_model", "simulate"]
