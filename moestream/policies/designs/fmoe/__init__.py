"""fMoE, as a package: the registered policies and the expert maps they search, in `policy.py`."""

from moestream.policies.designs.fmoe.policy import FMoE, FMoEConfig

__all__ = ["FMoE", "FMoEConfig"]
