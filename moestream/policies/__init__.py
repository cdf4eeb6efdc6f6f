"""Policies: predictors, eviction policies and planners, registered by name.

Importing this package imports every module in it, so each registers its classes.
"""

import sys

from moestream.policies.base import EVICTIONS, POLICIES, Policy
from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])

__all__ = ["EVICTIONS", "POLICIES", "Policy"]
