"""fMoE, as a package: the registered policies in `policy.py`, the expert maps they search in `maps.py`."""

from moestream.policies.designs.fmoe.policy import FMoE, FMoEConfig

__all__ = ["FMoE", "FMoEConfig"]
