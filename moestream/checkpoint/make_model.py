"""Write a randomly initialised MoE checkpoint of any supported family, in the family's real on-disk
format (what save_pretrained writes), with a small byte-level BPE tokenizer and the integrity manifest.

The model is never built in memory: names, shapes and dtypes come from the model on the meta device, and
each tensor is filled when the writer reaches it (`writer.py`), seeded by spec.seed and its name. Built in a
temporary directory renamed into place; with `spec.quant`, what the format's releases quantize is written
quantized (`quantized.py`). Knows families only through their adapters."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from moestream.atomic import publish_dir, write_json
from moestream.checkpoint import writer
from moestream.checkpoint.quantized import QUANT_LAYOUTS, quantize_units
from moestream.checkpoint.shards import INDEX_FILE
from moestream.checkpoint.spec import ModelSpec
from moestream.checkpoint.tokenizer import SpecialTokenIds, train_tokenizer
from moestream.checkpoint.verify import verify
from moestream.checkpoint.writer import TensorPlan
from moestream.errors import CheckpointError
from moestream.families.tiny import TEXT_KEYS, Sizes
from moestream.progress import progress_bar

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NOISE_STD = 0.05  # spread of the tensors a family asks to fill with noise (biases transformers zeroes)
DEFAULT_STD = 0.02  # for a config without initializer_range


def make_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config of the model `spec` describes."""
    adapter = spec.adapter()
    ids = SpecialTokenIds()
    kwargs = adapter.tiny_config_kwargs(Sizes(spec.num_layers, spec.num_experts, spec.resolved_top_k,
                                              spec.hidden_size, spec.intermediate_size, spec.vocab_size))
    special = dict(pad_token_id=ids.pad, bos_token_id=ids.bos, eos_token_id=ids.eos)
    kwargs |= special
    for key, sub in kwargs.items():  # a multimodal config's text part carries its own ids
        if key.startswith(TEXT_KEYS) and isinstance(sub, dict):
            sub |= special
    try:
        config = AutoConfig.for_model(spec.family, **(kwargs | spec.config_overrides))
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"invalid {spec.family} config: {error}") from None
    if config.is_encoder_decoder:
        config.decoder_start_token_id = ids.pad  # T5 convention: decoding starts from the pad token
    adapter.blocks(config)  # a config with no MoE layer is refused here, before anything is written
    return config


def meta_model(spec: ModelSpec, config: PretrainedConfig) -> torch.nn.Module:
    """The model on the meta device: its structure, dtypes and final config, no memory."""
    auto_class = getattr(transformers, spec.adapter().auto_class)
    with torch.device("meta"):
        return auto_class.from_config(config, dtype=DTYPES[spec.dtype])


def disk_tensors(model: torch.nn.Module) -> list[list[TensorPlan]]:
    """The tensors save_pretrained writes for `model` (tied copies, ignored keys left out), in units kept in one
    shard: a numbered layer's tensors (as transformers saves them) are one unit, any other tensor its own."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    transposed = _published_transposed(model)
    units: dict[str, list[TensorPlan]] = {}
    for name, tensor in revert_weight_conversion(model, state).items():
        shape = tuple(tensor.shape)
        if name in transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        parts = name.split(".")  # a unit: the prefix up to the first numbered component ("model.layers.3"), or name
        number = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        unit = name if number is None else ".".join(parts[: number + 1])
        units.setdefault(unit, []).append(TensorPlan(name, shape, tensor.dtype))
    return list(units.values())


def _published_transposed(model: torch.nn.Module) -> set[str]:
    """Disk names of fused expert tensors releases store transposed (save_pretrained would keep the memory layout)."""
    from moestream.families import derive

    parts = (derive.disk_part(model, path, param) for path, module in derive.experts_modules(model)
             for param, _ in module.named_parameters(recurse=False))
    return {name for part in parts if part.transposed for name in part.names}


def tensor_seed(seed: int, name: str) -> int:
    """A generator seed of its own for each tensor (stable across runs, machines and worker counts)."""
    digest = hashlib.blake2b(f"moestream:{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def init_kind(name: str, noise_suffixes: tuple[str, ...]) -> str:
    """How a tensor is filled: "noise", "ones" (norm weights), "zeros" (biases) or "normal"."""
    if name.endswith(noise_suffixes):
        return "noise"
    module, _, leaf = name.rpartition(".")
    if leaf == "weight" and "norm" in module.rpartition(".")[2]:
        return "ones"
    return "zeros" if leaf == "bias" or leaf.endswith("_bias") else "normal"


def filler(spec: ModelSpec, config: PretrainedConfig) -> writer.Fill:
    """The function that gives each planned tensor its values."""
    adapter = spec.adapter()
    noise = tuple(adapter.noise_init)
    scales = _scales(config)

    def fill(tensor: TensorPlan) -> torch.Tensor:
        fixed = adapter.init_values(tensor.name, tensor.shape, tensor.dtype)
        if fixed is not None:
            return fixed
        kind = init_kind(tensor.name, noise)
        if kind == "zeros" or not tensor.dtype.is_floating_point:  # integer buffers (tables, counters): zeros
            return torch.zeros(tensor.shape, dtype=tensor.dtype)
        if kind == "ones":
            return torch.full(tensor.shape, scales(tensor, kind), dtype=tensor.dtype)
        generator = torch.Generator().manual_seed(tensor_seed(spec.seed, tensor.name))
        values = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        return values.mul_(scales(tensor, kind))

    return fill


def _scales(config: PretrainedConfig) -> Callable[[TensorPlan, str], float]:
    """A tensor's std (its value for norm weights): with an initializer_range, that std and norms 1; else T5's
    (initializer_factor F): norms F, embeddings, head and routers N(0, F), other weights N(0, F / sqrt(fan in))."""
    factor = getattr(config, "initializer_factor", None)
    if getattr(config, "initializer_range", None) or factor is None:
        std = float(getattr(config, "initializer_range", None) or DEFAULT_STD)
        return lambda tensor, kind: {"ones": 1.0, "noise": NOISE_STD}.get(kind, std)

    def t5_scale(tensor: TensorPlan, kind: str) -> float:
        if kind in ("ones", "noise"):
            return factor if kind == "ones" else NOISE_STD
        whole_rows = tensor.shape[0] == config.vocab_size or "router" in tensor.name
        return factor if whole_rows or len(tensor.shape) < 2 else factor * tensor.shape[-1] ** -0.5

    return t5_scale


def _write_metadata(spec: ModelSpec, model: torch.nn.Module, directory: Path, quantization_config: dict | None) -> None:
    """config.json (with quantization_config), generation_config.json and the tokenizer, as save_pretrained."""
    config = model.config
    config.architectures = [type(model).__name__]
    if quantization_config is not None:
        config.quantization_config = quantization_config
    config.save_pretrained(directory)
    if model.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(directory)
    train_tokenizer(spec.tokenizer_vocab_size or spec.vocab_size).save_pretrained(directory)


def _write(spec: ModelSpec, directory: Path, progress: bool, workers: int) -> None:
    config = make_config(spec)  # config and tokenizer first: their errors come before any progress output
    model = meta_model(spec, config)
    layout = None if spec.quant is None else QUANT_LAYOUTS.create(spec.quant, spec)
    _write_metadata(spec, model, directory, None if layout is None else layout.quantization_config())
    units, fill = disk_tensors(model), filler(spec, config)
    if layout is not None:
        units, fill = quantize_units(layout, units, fill)
    total = sum(tensor.nbytes for unit in units for tensor in unit)
    with progress_bar(total=total, desc=f"make-model {spec.family}", disable=not progress, unit="B",
                      unit_scale=True) as bar:
        shards = writer.plan_shards(units, spec.max_shard_bytes)
        names = writer.shard_names(len(shards))
        for shard, name in zip(shards, names):
            writer.write_shard(directory / name, shard, fill, workers, bar.update)
        if len(shards) > 1:
            write_json(writer.index(shards, names), directory / INDEX_FILE)
    with progress_bar(total=total, desc="manifest", disable=not progress, unit="B", unit_scale=True) as bar:
        # writes moestream-manifest.json: the digests of what was just written
        verify(directory, bar.update, on_start=lambda shard_bytes: bar.reset(total=shard_bytes))


def make_model(spec: ModelSpec, out: str | Path, progress: bool = False, workers: int | None = None) -> Path:
    """Write the checkpoint `spec` describes to `out` (absent or empty). workers: fill threads (default: CPUs, <=16)."""
    workers = workers or max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                    else os.cpu_count() or 1))
    out = publish_dir(Path(out), lambda tmp: _write(spec, tmp, progress, workers), CheckpointError)
    logger.info("wrote %s checkpoint to %s", spec.family, out)
    return out
