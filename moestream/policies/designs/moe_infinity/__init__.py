"""MoE-Infinity, as a package: the registered policies and the EAMs they match, in `policy.py`."""

from moestream.policies.designs.moe_infinity.policy import MoEInfinity, MoEInfinityConfig

__all__ = ["MoEInfinity", "MoEInfinityConfig"]
