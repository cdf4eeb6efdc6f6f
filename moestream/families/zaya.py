"""ZAYA: its router supports top-1 only, and its balancing biases are set on load (zeros, the last -1)
whatever a checkpoint holds, so a test model stores those values."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("zaya")
class ZayaAdapter(FamilyAdapter):
    fixed_top_k = 1

    def init_values(self, name, shape, dtype):
        if not name.endswith(".balancing_biases"):
            return None
        import torch

        values = torch.zeros(shape, dtype=dtype)
        values[-1] = -1.0
        return values
