"""Published designs, one module each: MoE-Infinity, ExpertFlow, fMoE and ProMoE, with their ablations.

Importing this package imports each of its modules, so that each registers its policies.
"""

import sys

from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])
