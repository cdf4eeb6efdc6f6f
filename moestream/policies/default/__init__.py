"""`default`: moestream's lean default policy, one entry point (policy.Default). model.py: settings, weights
and the forward pass; features.py: its inputs for whole traces, state.py: kept online (kernels.py: compiled);
reuse.py: the chance of reuse ahead; duel.py: the model against recency; training.py: torch training
(imported lazily); policy.py: predictor, eviction, the registered policy and reading its weights.
"""

from moestream.policies.default.policy import Default

__all__ = ["Default"]
