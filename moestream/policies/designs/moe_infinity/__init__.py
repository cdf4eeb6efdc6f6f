"""MoE-Infinity, as a package: the registered policies in `policy.py`, the EAMs they match in `eams.py`."""

from moestream.policies.designs.moe_infinity.policy import MoEInfinity, MoEInfinityConfig

__all__ = ["MoEInfinity", "MoEInfinityConfig"]
