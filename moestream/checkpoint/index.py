"""Index a checkpoint directory: its config, family adapter, where every routed expert's bytes are on disk
(`ExpertIndex`), and which tensors are dense (everything else), all from safetensors headers.

For each expert, the adapter's `parts` name the disk tensors that, in order, fill its slot; a tensor fused over
experts contributes its slice [e]. A quantized checkpoint's experts are laid out from its codec's disk parts,
widest dtype first so that every typed view of a slot is aligned. Knows families only through `adapter_for`,
quantization only through `codec_for`, and nothing of policies."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, PretrainedConfig

from moestream.checkpoint.layout import ExpertIndex, ExpertLocation, PartView, Segment
from moestream.checkpoint.shards import TensorInfo, read_tensors
from moestream.errors import CheckpointError
from moestream.families import adapter_for
from moestream.families.base import ExpertPart, FamilyAdapter, MoEBlock
from moestream.quant import ExpertCodec, codec_for
from moestream.topology import ExpertKey, Topology


@dataclass(frozen=True)
class CheckpointIndex:
    path: Path
    config: PretrainedConfig
    adapter: FamilyAdapter
    blocks: tuple[MoEBlock, ...]  # one per MoE layer, in MoE-layer order
    experts: ExpertIndex
    dense: dict[Path, tuple[str, ...]]  # shard file -> its non-expert tensor names (disk keys), by offset
    tensors: dict[str, TensorInfo]  # every tensor of the checkpoint, by disk key
    codec: ExpertCodec | None = None  # how its experts are quantized; None: they are not

    @property
    def topology(self) -> Topology:
        return self.experts.topology

    def is_expert_key(self, key: str) -> bool:
        """Whether a model key is a routed expert parameter (the store's), or under a swapped experts module."""
        owner, _, name = key.rpartition(".")
        if self.adapter.uses_experts_registry:
            return owner in self._experts_paths and name in self._expert_params
        return any(key.startswith(f"{path}.") for path in self._experts_paths)

    @functools.cached_property
    def _experts_paths(self) -> frozenset[str]:
        return frozenset(block.experts_path for block in self.blocks)

    @functools.cached_property
    def _expert_params(self) -> frozenset[str]:
        return frozenset(part.param for part in self.adapter.expert_parts(self.config))

    def dense_names(self) -> list[str]:
        return [name for names in self.dense.values() for name in names]


def load_config(path: Path) -> PretrainedConfig:
    """The checkpoint's transformers config; CheckpointError for a missing dir, file or family."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {path}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{config_file} is not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_file} is not valid JSON (line {error.lineno} column {error.colno}: "
                              f"{error.msg})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object")
    adapter_for(SimpleNamespace(model_type=config.get("model_type")))
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"cannot read {config_file}: {error}") from None


def _part_slices(part: ExpertPart, block: MoEBlock, expert: int, num_experts: int,
                 tensors: dict[str, TensorInfo]) -> tuple[tuple[int, ...], torch.dtype, list[Segment]]:
    """(per-expert shape, dtype, disk segments) of one part of one expert."""
    shapes, dtypes, segments = [], set(), []
    for template in part.disk:
        name = f"{block.disk_prefix}.{template.format(expert=expert)}"
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(f"missing expert tensor {name} (MoE layer {block.moe_index}, expert {expert})")
        shape, offset, nbytes = info.shape, info.offset, info.nbytes
        if part.fused_on_disk:
            if not shape or shape[0] != num_experts:
                raise CheckpointError(f"tensor {name} has shape {shape}; expected [{num_experts}, ...] over experts")
            shape, nbytes = shape[1:], nbytes // num_experts
            offset += expert * nbytes
        shapes.append(shape)
        dtypes.add(info.dtype)
        segments.append(Segment(info.file, offset, nbytes))
    if len(dtypes) != 1 or any(not s or s[1:] != shapes[0][1:] for s in shapes):
        raise CheckpointError(f"tensors of {part.param} for expert {expert} of {block.disk_prefix} "
                              f"cannot be concatenated: shapes {shapes}, dtypes {sorted(map(str, dtypes))}")
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    return shape, dtypes.pop(), segments


def _merge(segments: list[Segment]) -> tuple[Segment, ...]:
    """Join segments that are back to back in the same file (fewer reads, same bytes)."""
    merged: list[Segment] = []
    for seg in segments:
        last = merged[-1] if merged else None
        if last is not None and last.file == seg.file and last.offset + last.nbytes == seg.offset:
            merged[-1] = Segment(last.file, last.offset, last.nbytes + seg.nbytes)
        else:
            merged.append(seg)
    return tuple(merged)


def _layout(shapes_dtypes: list[tuple[tuple[int, ...], torch.dtype]], parts) -> tuple[PartView, ...]:
    views, offset = [], 0
    for part, (shape, dtype) in zip(parts, shapes_dtypes):
        if offset % dtype.itemsize:
            raise CheckpointError(f"part {part.param} ({dtype}) would start at unaligned slot offset {offset}")
        # stored with its last two dimensions swapped (transformers transposes it on load): the slot keeps the
        # disk's bytes, the view swaps them back
        swapped = (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape
        transposed = part.may_transpose and tuple(shape) != part.shape and swapped == part.shape
        views.append(PartView(part.param, swapped if transposed else shape, dtype, offset, transposed))
        offset += views[-1].nbytes
    return tuple(views)


def _index_experts(adapter: FamilyAdapter, parts: tuple[ExpertPart, ...], config, blocks,
                   tensors) -> tuple[ExpertIndex, set[str]]:
    """The ExpertIndex of experts made of `parts` and the set of disk tensor names it covers."""
    num_experts = adapter.num_experts(config)
    locations: dict[ExpertKey, ExpertLocation] = {}
    expected = None
    for block in blocks:
        for expert in range(num_experts):
            found = [_part_slices(p, block, expert, num_experts, tensors) for p in parts]
            shapes_dtypes = [(shape, dtype) for shape, dtype, _ in found]
            expected = expected or shapes_dtypes
            if shapes_dtypes != expected:
                raise CheckpointError(f"expert {expert} of {block.disk_prefix} has (shape, dtype) per part "
                                      f"{shapes_dtypes}, but the first expert has {expected}")
            key = ExpertKey(block.moe_index, expert)
            locations[key] = ExpertLocation(key, _merge([s for _, _, segs in found for s in segs]))
    layout = _layout(expected, parts)
    expert_bytes = sum(p.nbytes for p in layout)
    covered = {f"{b.disk_prefix}.{t.format(expert=e)}" for b in blocks for p in parts for t in p.disk
               for e in range(num_experts)}
    return ExpertIndex(adapter.topology(config, expert_bytes), locations, layout), covered


def build_index(path: str | Path) -> CheckpointIndex:
    """Index the checkpoint in directory `path` from its config and safetensors headers."""
    path = Path(path)
    config = load_config(path)
    adapter = adapter_for(config)
    tensors = read_tensors(path)
    blocks = tuple(adapter.blocks(config))
    if not blocks:
        raise CheckpointError(f"the config in {path} declares no MoE layers")
    codec, parts, num_experts = codec_for(config), adapter.expert_parts(config), adapter.num_experts(config)
    if codec is not None:
        parts = codec.disk_parts(parts)  # widest dtype first (stable): each part starts where its dtype divides
        width = {p.param: _part_slices(p, blocks[0], 0, num_experts, tensors)[1].itemsize for p in parts}
        parts = tuple(sorted(parts, key=lambda p: -width[p.param]))
    experts, expert_names = _index_experts(adapter, parts, config, blocks, tensors)
    dense: dict[Path, list[TensorInfo]] = {}
    for info in tensors.values():
        if info.name not in expert_names:
            dense.setdefault(info.file, []).append(info)
    by_shard = {file: tuple(t.name for t in sorted(infos, key=lambda t: t.offset)) for file, infos in dense.items()}
    return CheckpointIndex(path, config, adapter, blocks, experts, by_shard, tensors, codec)
