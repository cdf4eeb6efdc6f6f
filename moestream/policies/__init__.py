"""Policies: predictors, eviction policies and planners, registered by name (the contract and registries:
`moestream.contracts`, re-exported here). `driver` is the one place that calls a policy; building blocks
are `eviction`, `planning`, `routing_stats` and `trained`; one package per kind of policy: `baselines`,
`designs` (published) and `default` (moestream's own); the offline bounds are the simulator's
(`moestream.bench.sim.bounds`). Importing this package imports
every module in it, so each registers its classes; none imports torch (training imports it when it runs).
"""

import sys

from moestream.contracts import EVICTIONS, PLANNERS, POLICIES, Policy
from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])
for plugins in ("baselines", "designs"):  # packages of plugin modules, one design or kind each
    import_submodules(sys.modules[f"{__name__}.{plugins}"])

__all__ = ["EVICTIONS", "PLANNERS", "POLICIES", "Policy"]
