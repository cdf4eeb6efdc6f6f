"""Baselines: reactive caches (lru, lfu) and simple predictors (static, token, cooccur, token-cooccur).

Importing this package imports each of its modules, so that each registers its policies.
"""

import sys

from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])
