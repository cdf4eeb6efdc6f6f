"""`default`: moestream's lean default policy, one package with one entry point (policy.Default).

- model.py: settings, weights and the one forward pass (numpy online, torch in training)
- features.py: the model's inputs for whole traces; state.py: the same inputs kept online
- reuse.py: the chance of reuse 1 to 8 iterations ahead, which the eviction's expected waits come from
- training.py: torch training (imported lazily); storage.py: reading the weights without torch
- policy.py: predictor, eviction and the registered policy (its decision cost: moestream/bench/decision_cost.py)
"""

from moestream.policies.default.policy import Default

__all__ = ["Default"]
