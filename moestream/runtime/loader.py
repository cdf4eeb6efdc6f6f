"""Builds a transformers model whose dense part is real and whose routed experts never leave disk.

The skeleton is built on the meta device; every dense tensor is then read (its own byte range, readahead
off, so no expert bytes are read), renamed as transformers' loading does (`DenseConversion`), decoded
by the codec where stored quantized, and placed on the device one at a time; tied weights are tied and
non-persistent buffers computed by the model's initialiser. Routed experts and multimodal towers
(`towers`, never run for text) stay on meta. `dense_modules` finds dense modules by role from the
decoder layout. Knows no policy and names no family.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers

from moestream.checkpoint.index import CheckpointIndex
from moestream.checkpoint.shards import TensorInfo
from moestream.errors import CheckpointError
from moestream.families.derive import DenseConversion, towers
from moestream.progress import progress_bar
from moestream.quant.decoder import ExpertDecoder

log = logging.getLogger(__name__)


def compute_dtype(config) -> torch.dtype:
    return getattr(config, "dtype", None) or torch.float32


def build_skeleton(checkpoint: CheckpointIndex) -> torch.nn.Module:
    auto_class = getattr(transformers, checkpoint.adapter.auto_class)
    dtype = compute_dtype(checkpoint.config)
    with torch.device("meta"):
        model = auto_class.from_config(checkpoint.config, dtype=dtype)
    return model.eval()


def load_dense(model: torch.nn.Module, checkpoint: CheckpointIndex, device: str, progress: bool = False) -> None:
    """Reads every dense tensor onto `device`; raises CheckpointError if the model lacks any."""
    expected = set(model.state_dict(keep_vars=True))
    groups = checkpoint.codec.dense_groups(checkpoint.dense_names()) if checkpoint.codec is not None else {}
    quantized = {name for group in groups.values() for name in group.values()}
    loaded: set[str] = set()
    conversion = DenseConversion(model, skip=towers(model))
    total = sum(len(names) for names in checkpoint.dense.values())
    with progress_bar(total=total, desc="loading dense weights", unit="tensor", disable=None if progress else True) as bar:
        for file, names in checkpoint.dense.items():
            loaded |= _load_file(model, checkpoint, file, [n for n in names if n not in quantized], conversion,
                                 device, bar)
        for name, group in groups.items():
            loaded |= _load_quantized(model, checkpoint, name, group, conversion.rename(name)[0], device)
            bar.update(len(group))
        loaded |= {key for key, value in conversion.converted().items() if _assign(model, key, value, device)}
    missing = {key for key in expected - loaded if not checkpoint.is_expert_key(key)}
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    still_meta = [key for key, value in model.state_dict(keep_vars=True).items()
                  if value.is_meta and not checkpoint.is_expert_key(key) and not conversion.skipped(key)]
    if still_meta:
        raise CheckpointError(f"checkpoint {checkpoint.path} lacks dense tensor {sorted(still_meta)[0]}"
                              f" ({len(still_meta)} missing in all)")


def _load_file(model, checkpoint: CheckpointIndex, file: Path, names, conversion: DenseConversion, device: str,
               bar) -> set[str]:
    loaded = set()
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into expert bytes
            for name in names:
                key, merged = conversion.rename(name)
                if conversion.skipped(key):  # a tower that generating text never runs: not read
                    bar.update(1)
                    continue
                tensor = _read_tensor(fd, checkpoint.tensors[name])
                if merged is not None:  # merged with others on load: converted once all are read
                    conversion.collect(key, name, merged, tensor)
                elif _assign(model, key, tensor, device):
                    loaded.add(key)
                bar.update(1)
        finally:
            os.close(fd)
    except (OSError, RuntimeError, KeyError) as error:
        raise CheckpointError(f"cannot read dense tensors from {file}: {error}") from None
    return loaded


def _load_quantized(model, checkpoint: CheckpointIndex, name: str, group: dict[str, str], key: str,
                    device: str) -> set[str]:
    """One dense tensor stored quantized, read and decoded by the codec."""
    tensors = {}
    for role, disk_name in group.items():
        info = checkpoint.tensors[disk_name]
        try:
            fd = os.open(info.file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                tensors[role] = _read_tensor(fd, info)
            finally:
                os.close(fd)
        except OSError as error:
            raise CheckpointError(f"cannot read dense tensor {disk_name} from {info.file}: {error}") from None
    value = checkpoint.codec.decode_dense(tensors, compute_dtype(checkpoint.config))
    return {key} if _assign(model, key, value, device) else set()


def _read_tensor(fd: int, info: TensorInfo) -> torch.Tensor:
    data = bytearray(info.nbytes)
    view, got = memoryview(data), 0
    while got < info.nbytes:
        n = os.preadv(fd, [view[got:]], info.offset + got)
        if n == 0:
            raise OSError(f"the file ends before tensor {info.name!r} does")
        got += n
    if not info.nbytes:
        return torch.empty(info.shape, dtype=info.dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(info.dtype).reshape(info.shape)


def _assign(model: torch.nn.Module, key: str, value: torch.Tensor, device: str) -> bool:
    owner_name, _, attr = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        owner = None
    target = None if owner is None else owner._parameters.get(attr, owner._buffers.get(attr))
    if target is None:
        if not _ignored_on_load(model, key):
            raise CheckpointError(f"unexpected tensor {key} in the checkpoint: the {type(model).__name__} of its "
                                  "config has no such parameter")
        log.info("ignoring checkpoint tensor %s, as transformers does", key)
        return False
    if tuple(target.shape) != tuple(value.shape):
        raise CheckpointError(f"tensor {key} has shape {tuple(value.shape)} in the checkpoint, "
                              f"the model expects {tuple(target.shape)}")
    value = value.to(device=device, dtype=target.dtype if value.is_floating_point() else value.dtype)
    if attr in owner._parameters:
        owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value
    return True


def _ignored_on_load(model: torch.nn.Module, key: str) -> bool:
    """Whether transformers ignores the key when loading (a multi-token-prediction layer, an old buffer)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(pattern, key) for pattern in patterns)


def materialize_buffers(model: torch.nn.Module, device: str) -> None:
    """Computes non-persistent buffers left on meta (e.g. rotary inv_freq)."""
    owners = {}
    skip = tuple(f"{path}." for path in towers(model))
    for name, buffer in model.named_buffers():
        if name.startswith(skip):
            continue  # a tower that generating text never runs stays on meta
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if buffer.is_meta and attr in owner._non_persistent_buffers_set:
            owner._buffers[attr] = torch.empty_like(buffer, device=device)
            owners[owner_name] = owner
    for owner in owners.values():
        kept = {name: value.detach().clone() for name, value in owner.named_parameters()}
        with torch.no_grad():
            model._init_weights(owner)  # computes the buffers; parameters it re-initialises are put back
        for name, value in kept.items():
            module_name, _, attr = name.rpartition(".")
            module = owner.get_submodule(module_name)
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


def load_model(checkpoint: CheckpointIndex, device: str, progress: bool = False) -> torch.nn.Module:
    context = torch.cuda.device(device) if torch.device(device).type == "cuda" else nullcontext()
    with context:
        model = build_skeleton(checkpoint)
        load_dense(model, checkpoint, device, progress)
        materialize_buffers(model, device)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(head_input_hook)
    return model


# a dense module's role by its name's last part; dense_modules adds "dense mlp" and "head"
DENSE_ROLES = {"self_attn": "attention", "SelfAttention": "attention", "EncDecAttention": "attention",  # T5's
               "shared_experts": "shared experts", "shared_expert": "shared experts"}


def dense_modules(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """role -> the model's modules of that role, in order: "attention", "shared experts", "dense mlp" (an
    `mlp` without routed experts) and "head"."""
    roles: dict[str, list[torch.nn.Module]] = {}
    for name, module in model.named_modules():
        suffix = name.rsplit(".", 1)[-1]
        role = DENSE_ROLES.get(suffix) or ("dense mlp" if suffix == "mlp" and not hasattr(module, "experts") else None)
        if role == "shared experts" and isinstance(getattr(module, "shared", None), torch.nn.Module):
            module = module.shared  # launched first (runtime/experts.py): the module that computes
        if role is not None:
            roles.setdefault(role, []).append(module)
    head = model.get_output_embeddings()
    if head is not None:
        roles["head"] = [head]
    return roles


def head_input_hook(module: torch.nn.Module, args: tuple) -> tuple:
    """Gives the output head's input standard strides: at prefill a [B, 1, H] view of batch stride T * H
    sends torch's CPU bf16 linear down a path that copies the weight (6.6 s, +208 MiB for a [102400, 1024]
    head, against 0.1 s). The copy costs B * H elements; the logits are bit-identical."""
    return (args[0].clone(memory_format=torch.contiguous_format), *args[1:])


def expert_decoder(checkpoint: CheckpointIndex, device: str) -> ExpertDecoder | None:
    """The decoder of a quantized checkpoint's experts (scratch on `device`), None if unquantized."""
    if checkpoint.codec is None:
        return None
    return ExpertDecoder(checkpoint.codec, checkpoint.experts.layout, compute_dtype(checkpoint.config), device)


def generation_config(checkpoint: CheckpointIndex) -> transformers.GenerationConfig:
    """The checkpoint's generation_config.json if it has one, else the one its config implies."""
    if (checkpoint.path / "generation_config.json").is_file():
        try:
            return transformers.GenerationConfig.from_pretrained(checkpoint.path)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"cannot read {checkpoint.path / 'generation_config.json'}: {error}") from None
    return transformers.GenerationConfig.from_model_config(checkpoint.config)
