"""The model types transformers declares MoE experts for: every model whose modeling file decorates an
experts class with `@use_experts_implementation`, and the auto class that generates text with each.
Read from the installed transformers (its source files: importing this module imports none of it); knows no family."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

MARK = "@use_experts_implementation"
# the auto classes that generate text, in the order one is chosen: a causal LM, else the multimodal
# model whose text part runs alone on input ids
GENERATING = (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
              ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
              ("AutoModelForMultimodalLM", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"))


@functools.cache
def experts_model_types() -> tuple[str, ...]:
    """Every model type (a models/ folder of transformers) with an experts implementation, sorted."""
    models = Path(importlib.util.find_spec("transformers").submodule_search_locations[0]) / "models"
    return tuple(sorted({path.parent.name for path in models.glob("*/modeling_*.py")
                         if MARK in path.read_text(encoding="utf-8", errors="replace")}))


@functools.cache
def generating_class(model_type: str) -> str | None:
    """The auto class that generates text for `model_type` from the published config, None if none does: a causal
    LM on the model type's own config (a multimodal release publishes no text part alone), else a multimodal one."""
    import transformers
    from transformers.models.auto import modeling_auto

    for auto_class, mapping in GENERATING:
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        config_class = getattr(getattr(transformers, name, None), "config_class", None) if name else None
        if name is not None and getattr(config_class, "model_type", None) in (model_type, None):
            return auto_class
    return None
