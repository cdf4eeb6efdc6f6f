"""A family's expert layout derived from what transformers declares: the model built on the meta device
(every `@use_experts_implementation` module is a MoE block), and the checkpoint conversion mapping
(`revert_weight_conversion`: the disk tensors of each fused expert parameter and every dense tensor's name).

An expert part is read as bytes only if one expert's disk tensors, concatenated, are the bytes of its slice of
the fused parameter, or of that slice transposed; `disk_part` checks that on a small tensor of known values, so
a layout transformers interleaves or dequantizes on load is refused with its reason, never read wrong. Knows no
family by name, nor the store or the engine."""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moestream.errors import CheckpointError

if TYPE_CHECKING:
    import torch

EXPERT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")  # set by use_experts_implementation
PROBE_EXPERTS = 2  # experts in the small tensor that probes a conversion
PROBE_DIMS = (4, 6, 10)  # its other dimensions: even, distinct, so a transpose or a split shows


@dataclass(frozen=True)
class DiskPart:
    """One fused expert parameter as stored: expert {expert}'s disk tensors, in slice order, or one over all experts."""

    param: str
    names: tuple[str, ...]  # full disk names with {expert}
    fused: bool
    transposed: bool = False  # one tensor over all experts, each expert's dimensions swapped where its shape says


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every experts implementation in the model, in model order."""
    return [(name, module) for name, module in model.named_modules()
            if all(hasattr(module, flag) for flag in EXPERT_FLAGS)]


def text_part(model: torch.nn.Module) -> torch.nn.Module:
    """The module that writes a model's text: the model, or the thinker of a wrapper without a forward (Qwen3-Omni)."""
    import torch

    wrapper = type(model).forward is torch.nn.Module.forward
    return model.thinker if wrapper and isinstance(getattr(model, "thinker", None), torch.nn.Module) else model


def experts_of_text(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """`experts_modules` of the text decoder (not a tower's, nor Qwen3-Omni's talker), paths in the whole model."""
    text = text_part(model)
    if text.config.get_text_config() is not text.config:
        text = text.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is text)
    return [(path, module) for path, module in experts_modules(model) if not prefix or path.startswith(f"{prefix}.")]


def towers(model: torch.nn.Module) -> tuple[str, ...]:
    """Paths of the modules that generating text from input ids never runs: a multimodal model's towers and
    projectors beside its text decoder (and an omni model's talker), not the embeddings or the head; () for text."""
    text = text_part(model)
    if text is model and text.config.get_text_config() is text.config:
        return ()
    decoder = text.get_decoder() if text.config.get_text_config() is not text.config else text
    paths = {module: name for name, module in model.named_modules()}
    keep = {decoder, text.get_output_embeddings(), text.get_input_embeddings()}
    found, path = [], paths[decoder]
    while path:
        parent_path = path.rpartition(".")[0]
        parent = model.get_submodule(parent_path) if parent_path else model
        for name, child in parent.named_children():
            child_path = f"{parent_path}.{name}" if parent_path else name
            if child_path != path and child not in keep and not any(
                    m is k for k in keep if k is not None for m in child.modules()):
                found.append(child_path)
        path = parent_path
    return tuple(found)


def layer_number(path: str) -> int:
    """The decoder-layer index in a module path: its first all-digit component."""
    for component in path.split("."):
        if component.isdigit():
            return int(component)
    raise CheckpointError(f"experts module {path} is not inside a numbered layer")


def meta_model(config, auto_class: str) -> torch.nn.Module:
    """The model of `config` on the meta device, built from a copy (building a model writes into its config)."""
    import torch
    import transformers

    config = copy.deepcopy(config)
    with torch.device("meta"):
        return getattr(transformers, auto_class).from_config(config, dtype=config.dtype or torch.float32).eval()


def _templates(names: list[str]) -> tuple[str, ...]:
    """One expert's names with {expert} where experts are numbered, in first-seen order (found per probe expert)."""
    split = [name.split(".") for name in names]
    for position in range(min(map(len, split))):
        if any(parts[position] not in ("0", "1") for parts in split):
            continue
        templates: dict[str, set[str]] = {}
        for parts in split:
            templates.setdefault(".".join(parts[:position] + ["{expert}"] + parts[position + 1:]), set()).add(
                parts[position])
        if all(found == {"0", "1"} for found in templates.values()) and len(templates) * 2 == len(names):
            return tuple(templates)
    raise CheckpointError(f"cannot tell the expert index in disk names {', '.join(names[:4])}")


def disk_part(model: torch.nn.Module, path: str, param: str) -> DiskPart:
    """How the checkpoint stores `param` of the experts module at `path`, checked on probe values."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    key = f"{path}.{param}"
    dims = (PROBE_EXPERTS, *PROBE_DIMS[: getattr(model.get_submodule(path), param).dim() - 1])  # probe size
    value = torch.arange(torch.Size(dims).numel(), dtype=torch.float32).reshape(dims)  # distinct values
    try:
        disk = revert_weight_conversion(model, {key: value})
    except Exception as error:  # a converter that cannot run at probe size: a reason, not a crash
        raise CheckpointError(f"the conversion of {key} cannot be derived: {type(error).__name__}: {error}") from None
    if len(disk) == 1:
        (name, tensor), = disk.items()
        if tensor.shape == value.shape and torch.equal(tensor, value):
            return DiskPart(param, (name,), True)
        if value.dim() == 3 and torch.equal(tensor, value.transpose(1, 2)):
            return DiskPart(param, (name,), True, transposed=True)
        raise CheckpointError(f"{key} is stored as {name} in another layout (interleaved or quantized)")
    templates = _templates(list(disk))
    for expert in range(PROBE_EXPERTS):
        pieces = [disk[t.format(expert=expert)].flatten() for t in templates]
        if not torch.equal(torch.cat(pieces), value[expert].flatten()):
            raise CheckpointError(f"{key} is stored as {', '.join(t.format(expert=expert) for t in templates)} "
                                  "in another layout (transposed or interleaved): not a byte copy")
    return DiskPart(param, templates, False)


def block_prefix(names: list[str], experts_path: str) -> str:
    """The MoE block's prefix on disk: the longest dotted prefix the names share, without the experts module's
    own name (so that parts read "experts.{expert}.w1.weight" under "model.layers.3.block_sparse_moe")."""
    split = [name.split(".")[:-1] for name in names]  # a name's last component is never the prefix
    shared = [components[0] for components in itertools.takewhile(
        lambda components: len(set(components)) == 1 and "{expert}" not in components[0], zip(*split))]
    prefix, leaf = ".".join(shared), experts_path.rpartition(".")[2]
    return prefix.rpartition(".")[0] if prefix.endswith(f".{leaf}") else prefix


def relative(names: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    return tuple(re.sub(rf"^{re.escape(prefix)}\.", "", name) for name in names)


class DenseConversion:
    """The dense tensors' disk names as transformers' loading renames them, and the tensors it merges on load (a
    `WeightConverter`: fused projections, stacked convolutions) collected and converted by that same converter."""

    def __init__(self, model: torch.nn.Module, skip: tuple[str, ...] = ()):
        """skip: module paths whose tensors are not loaded (`towers`)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._by_pattern = {pattern: c for c in self._converters for pattern in c.source_patterns}
        self._keys = dict.fromkeys(model.state_dict(keep_vars=True))
        self._model = model
        self._pending: dict = {}  # model key -> its converter, collecting its disk tensors
        self._skip = tuple(f"{path}." for path in skip)

    def skipped(self, key: str) -> bool:
        """Whether the model key belongs to a module that is not loaded."""
        return bool(self._skip) and key.startswith(self._skip)

    def rename(self, disk_name: str) -> tuple[str, str | None]:
        """(model key, matched converter pattern or None). A disk name that is already a model key stays so."""
        from transformers.core_model_loading import rename_source_key

        key, merged = rename_source_key(disk_name, self._renamings, self._converters, self._model.base_model_prefix,
                                        self._keys)
        return (disk_name, None) if key not in self._keys and disk_name in self._keys else (key, merged)

    def collect(self, key: str, disk_name: str, pattern: str, tensor: torch.Tensor) -> None:
        converter = self._pending.setdefault(key, copy.deepcopy(self._by_pattern[pattern]))
        converter.add_tensor(key, disk_name, pattern, tensor)

    def converted(self) -> dict[str, torch.Tensor]:
        """model key -> tensor of everything collected, converted; nothing stays collected."""
        out: dict[str, torch.Tensor] = {}
        for key, converter in self._pending.items():
            try:
                out |= converter.convert(key, model=self._model, config=self._model.config)
            except Exception as error:
                raise CheckpointError(f"cannot convert dense tensor {key} as transformers loads it: "
                                      f"{type(error).__name__}: {error}") from None
        self._pending = {}
        return out
