"""`default`: moestream's own policy, as a package. The entry point is `policy.Default`.

Modules: `policy` (the registered policy, its predictor and eviction), `model` (the routing model's
numpy forward pass and config), `state` (its online per-iteration state), `recall`, `memory`,
`channels` and `reuse` (its inputs), `training` (torch; imported only by `DefaultPredictor.fit`).
"""

from moestream.policies.default.policy import Default, DefaultConfig

__all__ = ["Default", "DefaultConfig"]
