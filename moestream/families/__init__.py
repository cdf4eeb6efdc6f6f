"""Model families: every model type transformers declares experts for (`catalog.py`), each an adapter derived
from transformers' declarations (`base.py`), plus one file per family only for what cannot be derived,
registered in `FAMILIES` by model_type. Importing this package imports every family file, then registers a
plain adapter for each remaining model type. `adapter_for(config)` picks a config's adapter; no mechanism
elsewhere in moestream branches on a family."""

import sys

from moestream.errors import CheckpointError
from moestream.families import catalog
from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter, MoEBlock
from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])
for _name in catalog.experts_model_types():
    if _name not in FAMILIES:
        FAMILIES.register(_name)(type(f"Derived_{_name}", (FamilyAdapter,), {"model_type": _name}))


def supported() -> list[str]:
    """The model types moestream loads."""
    return [name for name in FAMILIES.names() if FAMILIES.get(name).reason() is None]


def adapter_for(config) -> FamilyAdapter:
    """The adapter for a transformers config (anything with a `model_type`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        import transformers

        raise CheckpointError(f"model type {model_type!r} has no MoE experts in transformers "
                              f"{transformers.__version__}; `moestream families` lists the supported ones")
    family = FAMILIES.get(model_type)
    if family.reason() is not None:
        raise CheckpointError(f"model type {model_type!r} is not supported: {family.reason()}")
    return family()


__all__ = ["FAMILIES", "ExpertPart", "FamilyAdapter", "MoEBlock", "adapter_for", "supported"]
