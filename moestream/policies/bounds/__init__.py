"""Offline bounds that see the replayed trace's future (belady, oracle, lookahead-N, default-lookahead-4).

They run only in the simulator (`Policy.offline`), which hands them the trace through prepare().

Importing this package imports each of its modules, so that each registers its policies.
"""

import sys

from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])
