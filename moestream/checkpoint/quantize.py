"""`moestream quantize`'s writer: a copy of a checkpoint whose routed experts are quantized into
compressed-tensors' symmetric integer layouts (`encode.py`), the dense part byte for byte as it was: each
shard keeps its name, config.json gains the `quantization_config`, other files are copied, `verify` writes
the manifest. Written in a staging directory renamed into place once every input problem is ruled out.
Knows families only through their adapter's parts."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from moestream.atomic import check_empty_dir, publish_dir, write_json
from moestream.checkpoint import writer
from moestream.checkpoint.index import CheckpointIndex, build_index
from moestream.checkpoint.manifest import MANIFEST_FILE
from moestream.checkpoint.shards import INDEX_FILE
from moestream.checkpoint.verify import verify
from moestream.checkpoint.writer import TensorPlan
from moestream.errors import MoestreamError
from moestream.quant.codec import method_of
from moestream.quant.encode import IntScheme, quantize
from moestream.quant.kernels import LAYOUT_KEY, LAYOUT_VERSION
from moestream.quant.linears import WEIGHT

COPIED_SUFFIXES = (".safetensors", ".tmp")
SKIPPED = (INDEX_FILE, "config.json", MANIFEST_FILE)


def expert_weights(checkpoint: CheckpointIndex, scheme: IntScheme) -> dict[str, str]:
    """Disk name of every routed expert's linear weight -> its stem; MoestreamError for what cannot be quantized."""
    method = method_of(checkpoint.config)
    if method is not None:
        raise MoestreamError(f"--model {checkpoint.path} is already quantized ({method})")
    family = checkpoint.adapter.model_type
    found = {}
    for part in checkpoint.adapter.expert_parts(checkpoint.config):
        if part.fused_on_disk or not all(t.endswith(WEIGHT) for t in part.disk):
            raise MoestreamError(f"quantize: {family} stores its experts as {part.disk[0]!r}; supported: families "
                                 "with per-expert linear weights")
        for block, expert, template in itertools.product(checkpoint.blocks, range(checkpoint.topology.num_experts),
                                                         part.disk):
            name = f"{block.disk_prefix}.{template.format(expert=expert)}"
            _check_linear(checkpoint.tensors[name].shape, scheme)
            found[name] = name[: -len(WEIGHT)]
    return found


def _check_linear(shape: tuple[int, ...], scheme: IntScheme) -> None:
    if len(shape) != 2:
        raise MoestreamError(f"quantize: expert weights must be 2-D, found shape {shape}")
    scheme.groups(shape[1])
    if scheme.bits < 8 and shape[1] % (32 // scheme.bits):
        raise MoestreamError(f"quantize: the experts' input width {shape[1]} cannot be packed {32 // scheme.bits} to a word")


def shard_plans(checkpoint: CheckpointIndex, scheme: IntScheme,
                weights: dict[str, str]) -> tuple[dict[Path, list[TensorPlan]], dict[str, tuple[str, str]]]:
    """Per source shard its output tensors; output name -> (source name, suffix) of each quantized one."""
    shards: dict[Path, list[TensorPlan]] = {}
    sources: dict[str, tuple[str, str]] = {}
    for name, info in sorted(checkpoint.tensors.items(), key=lambda item: item[1].offset):
        plans = shards.setdefault(info.file, [])
        stem = weights.get(name)
        if stem is None:
            plans.append(TensorPlan(name, info.shape, info.dtype))
            continue
        for suffix, (shape, dtype) in scheme.suffixes(info.shape, info.dtype).items():
            plans.append(TensorPlan(f"{stem}.{suffix}", shape, dtype))
            sources[f"{stem}.{suffix}"] = (name, suffix)
    return shards, sources


def filler(checkpoint: CheckpointIndex, scheme: IntScheme, sources: dict[str, tuple[str, str]]) -> writer.Fill:
    """The values of each output tensor: the source's, or its quantization."""

    def fill(plan: TensorPlan) -> torch.Tensor:
        name, suffix = sources.get(plan.name, (plan.name, None))
        with safe_open(checkpoint.tensors[name].file, framework="pt") as handle:
            tensor = handle.get_tensor(name)
        return tensor.contiguous() if suffix is None else quantize(tensor, scheme, suffix).contiguous()

    return fill


def _write(checkpoint: CheckpointIndex, scheme: IntScheme, directory: Path, workers: int,
           on_bytes: Callable[[int], None]) -> None:
    shards, sources = shard_plans(checkpoint, scheme, expert_weights(checkpoint, scheme))
    fill = filler(checkpoint, scheme, sources)
    names = [file.name for file in shards]
    for file, plans in shards.items():
        writer.write_shard(directory / file.name, plans, fill, workers, on_bytes)
    if (checkpoint.path / INDEX_FILE).is_file():
        write_json(writer.index(list(shards.values()), names), directory / INDEX_FILE)
    config = json.loads((checkpoint.path / "config.json").read_text())  # marked with the layout version
    declared = scheme.quantization_config() | {LAYOUT_KEY: LAYOUT_VERSION}
    write_json(config | {"quantization_config": declared}, directory / "config.json")
    for path in checkpoint.path.iterdir():  # every other non-weight file as it is
        if path.is_file() and path.name not in SKIPPED and not path.name.endswith(COPIED_SUFFIXES):
            shutil.copy2(path, directory / path.name)
    verify(directory, lambda n: None)


def check_out(out: Path) -> None:
    check_empty_dir(out, name="--out")


def quantize_checkpoint(source: str | Path, out: str | Path, scheme: IntScheme, workers: int = 2,
                        on_bytes: Callable[[int], None] = lambda n: None) -> Path:
    """Writes the quantized copy of checkpoint `source` to `out` (absent or empty); returns `out`."""
    out = Path(out)
    check_out(out)
    checkpoint = build_index(source)
    expert_weights(checkpoint, scheme)  # every input error before anything is written
    return publish_dir(out, lambda tmp: _write(checkpoint, scheme, tmp, workers, on_bytes), name="--out")
