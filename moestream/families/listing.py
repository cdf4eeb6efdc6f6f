"""What `moestream families` shows for each model type: whether it loads (or why not), how its experts lie on disk, one
expert's bytes at the published shape (the config class's defaults, which are a released model's), and the quantized
formats its layout loads and its releases come in. Derived as the engine derives it; knows no family by name."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moestream.families import FAMILIES
from moestream.families.base import ExpertPart

PUBLISHED_DTYPE_BYTES = 2  # releases are bf16 unless quantized


@dataclass(frozen=True)
class FamilyRow:
    model_type: str
    reason: str | None  # None: supported
    layout: str = ""  # e.g. "per expert: gate_proj+up_proj, down_proj"
    expert_bytes: int | None = None  # one routed expert at the published shape, bf16; None: unknown
    loads: tuple[str, ...] = ()  # quantized formats its layout loads
    published: tuple[str, ...] = ()  # quantized formats `make-model --quant` writes for it


def describe(parts: tuple[ExpertPart, ...]) -> str:
    """A layout in a few words: per-expert tensors or tensors fused over experts."""
    if all(p.fused_on_disk for p in parts):
        turned = " (transposed)" if any(p.may_transpose for p in parts) else ""
        return "fused over experts: " + ", ".join(p.disk[0].removesuffix(".weight").rsplit(".", 1)[-1]
                                                  for p in parts) + turned
    names = ["+".join(t.split("{expert}.")[-1].removesuffix(".weight") for t in p.disk) for p in parts]
    return "per expert: " + ", ".join(names)


def loadable_formats(parts: tuple[ExpertPart, ...]) -> tuple[str, ...]:
    """Quantized methods whose codecs read this layout: linear codecs per-expert weights, MXFP4 fused ones."""
    if all(not p.fused_on_disk and all(t.endswith(".weight") for t in p.disk) for p in parts):
        return ("compressed-tensors", "fp8", "gptq")
    return ("mxfp4",) if all(p.fused_on_disk and not p.may_transpose for p in parts) else ()


def published_configs(model_type: str):
    """Config kwargs of the config class's defaults with a few layers (widths kept): 2, 4, 8, then all."""
    from transformers import AutoConfig

    from moestream.families import tiny

    defaults = AutoConfig.for_model(model_type)
    text = defaults.get_text_config().to_dict()
    layers = int(text.get("num_hidden_layers") or 1)
    for count in sorted({min(layers, n) for n in (2, 4, 8, layers)}):
        fields = {name: tiny.layer_list(text[name], count) for name in tiny.LAYER_LIST_FIELDS
                  if isinstance(text.get(name), list) and len(text[name]) >= count}
        if isinstance(text.get("per_layer_config"), dict):
            fields["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < count}
        yield tiny.text_kwargs(defaults.to_dict(), {"num_hidden_layers": count} | fields)


def row(model_type: str) -> FamilyRow:
    family = FAMILIES.get(model_type)
    published = tuple(family.quant_formats)
    if family.reason() is not None:
        return FamilyRow(model_type, family.reason(), published=published)
    layout, expert_bytes, loads = "", None, ()
    from transformers import AutoConfig

    for kwargs in published_configs(model_type):
        try:
            parts = family().expert_parts(AutoConfig.for_model(model_type, **kwargs))
            module_shapes = [p.shape for p in parts]
        except Exception:  # noqa: BLE001 - a config's own validation at too few layers: try more
            continue
        layout, loads = describe(parts), loadable_formats(parts)
        if all(module_shapes):
            expert_bytes = sum(math.prod(shape) for shape in module_shapes) * PUBLISHED_DTYPE_BYTES
        break
    return FamilyRow(model_type, None, layout, expert_bytes, loads, published)


def rows() -> list[FamilyRow]:
    """Every registered family, supported first, each group by name."""
    names = FAMILIES.names()
    return [row(n) for n in names if FAMILIES.get(n).reason() is None] + [
        row(n) for n in names if FAMILIES.get(n).reason() is not None]

