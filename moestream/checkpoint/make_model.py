"""Write a randomly initialised MoE checkpoint of any supported family, in the family's real on-disk
format (transformers' own save_pretrained), with a small byte-level BPE tokenizer.

The checkpoint is built in a temporary directory beside the output and renamed into place, so an
interrupted run leaves no partial checkpoint. It knows families only through their adapters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import torch
import transformers
from moestream.progress import progress_bar
from transformers import AutoConfig, PretrainedConfig

from moestream.atomic import make_readable, staging_dir
from moestream.checkpoint.spec import ModelSpec, demo_spec
from moestream.checkpoint.tokenizer import SpecialTokenIds, train_tokenizer
from moestream.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["ModelSpec", "build_model", "demo_spec", "make_config", "make_model"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NOISE_STD = 0.05  # spread of the tensors a family asks to fill with noise (biases transformers zeroes)


def make_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config of the model `spec` describes."""
    adapter = spec.adapter()
    ids = SpecialTokenIds()
    kwargs = adapter.tiny_config_kwargs(spec.num_layers, spec.num_experts, spec.resolved_top_k,
                                        spec.hidden_size, spec.intermediate_size, spec.vocab_size)
    kwargs |= dict(pad_token_id=ids.pad, bos_token_id=ids.bos, eos_token_id=ids.eos)
    try:
        config = AutoConfig.for_model(spec.family, **(kwargs | spec.config_overrides))
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"invalid {spec.family} config: {error}") from None
    if config.is_encoder_decoder:
        config.decoder_start_token_id = ids.pad  # T5 convention: decoding starts from the pad token
    if not adapter.blocks(config):
        raise CheckpointError(f"a {spec.family} model with {spec.num_layers} layer(s) has no MoE layer")
    return config


def build_model(spec: ModelSpec, config: PretrainedConfig) -> torch.nn.Module:
    """The randomly initialised model, seeded by spec.seed without touching the global RNG state."""
    adapter = spec.adapter()
    auto_class = getattr(transformers, adapter.auto_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = auto_class.from_config(config, dtype=DTYPES[spec.dtype])
        generator = torch.Generator().manual_seed(spec.seed + 1)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(adapter.noise_init):
                    tensor.copy_((torch.randn(tensor.shape, generator=generator) * NOISE_STD).to(tensor.dtype))
    return model.eval()


@contextlib.contextmanager
def _transformers_progress(enabled: bool):
    """Show transformers' own progress bars only when asked (restores the previous setting)."""
    bars = transformers.utils.logging
    was_enabled = bars.is_progress_bar_enabled()
    (bars.enable_progress_bar if enabled else bars.disable_progress_bar)()
    try:
        yield
    finally:
        (bars.enable_progress_bar if was_enabled else bars.disable_progress_bar)()


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output {out} already exists and is not an empty directory")


def _write(spec: ModelSpec, directory: Path, progress: bool) -> None:
    config = make_config(spec)  # config and tokenizer first: their errors come before any progress output
    tokenizer = train_tokenizer(spec.vocab_size)
    stages = progress_bar(total=3, desc=f"make-model {spec.family}", disable=not progress, unit="step")
    with stages, _transformers_progress(progress):
        model = build_model(spec, config)
        stages.update()
        model.save_pretrained(directory, max_shard_size=spec.max_shard_bytes or "1000GB")
        stages.update()
        tokenizer.save_pretrained(directory)
        stages.update()


def make_model(spec: ModelSpec, out: str | Path, progress: bool = False) -> Path:
    """Write the checkpoint `spec` describes to directory `out` (absent or empty); returns `out`."""
    out = Path(out)
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(out, "partial")
    try:
        _write(spec, tmp, progress)
        make_readable(tmp)
        _check_out(out)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s checkpoint to %s", spec.family, out)
    return out
