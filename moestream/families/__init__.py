"""Model families: one declarative `FamilyAdapter` per file, registered in `FAMILIES` by model_type.

Importing this package imports every adapter module. `adapter_for(config)` picks the adapter of a
transformers config; nothing else in moestream names a family.
"""

import sys

from moestream.errors import CheckpointError
from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter, MoEBlock
from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])


def adapter_for(config) -> FamilyAdapter:
    """The adapter for a transformers config (anything with a `model_type`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        supported = ", ".join(FAMILIES.names())
        raise CheckpointError(f"unsupported model family {model_type!r}; supported: {supported}")
    return FAMILIES.create(model_type)


__all__ = ["FAMILIES", "ExpertPart", "FamilyAdapter", "MoEBlock", "adapter_for"]
