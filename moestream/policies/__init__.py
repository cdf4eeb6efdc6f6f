"""Policies: predictors, eviction policies and planners, registered by name.

What every policy implements, and the registries, are `moestream.contracts` (re-exported here). The
tree shows the architecture: `driver` (the one place that calls a policy, in order), building blocks
(`eviction`, `planning`, `scored_eviction`, `routing_stats`, `trained`), and one package per kind of
policy: `baselines`, `bounds` (offline), `designs` (published designs) and `default` (moestream's own).
Importing this package imports every module and package in it, so each registers its classes;
none of them imports torch (training code imports it when it runs).
"""

import sys

from moestream.contracts import EVICTIONS, PLANNERS, POLICIES, Policy
from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])
for plugins in ("baselines", "bounds", "designs"):  # packages of plugin modules, one design or kind each
    import_submodules(sys.modules[f"{__name__}.{plugins}"])

__all__ = ["EVICTIONS", "PLANNERS", "POLICIES", "Policy"]
