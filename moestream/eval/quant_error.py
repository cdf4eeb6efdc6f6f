"""How far a quantized copy's outputs are from its source: next-token distributions of the source model (transformers'
own, dense) and of the same model with every routed expert replaced by the copy's decoding, both teacher-forced on the
source's greedy continuation of each prompt. Figures: top-1 agreement (where the source's best logits tie, as bf16
logits of a random model do, any of them agrees), mean KL(source || quantized) and max abs logit error over every
position. One model is in memory at a time: its experts are overwritten in place once the source's logits are taken.
Knows checkpoints and codecs, not stores, runtimes or policies."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import transformers

from moestream.checkpoint.index import CheckpointIndex, build_index
from moestream.checkpoint.layout import ExpertLocation
from moestream.quant.decoder import ExpertDecoder


@dataclass(frozen=True)
class QuantError:
    positions: int  # next-token distributions compared
    top1_agreement: float  # share of positions where the copy's argmax is a reference argmax (any of tied bests)
    mean_kl: float  # nats
    max_abs_logit_error: float


def read_expert(location: ExpertLocation) -> torch.Tensor:
    """An expert's slot bytes (1-D uint8) read from its segments."""
    data = bytearray(location.nbytes)
    view, at = memoryview(data), 0
    for segment in location.segments:
        fd = os.open(segment.file, os.O_RDONLY)
        try:
            at += os.preadv(fd, [view[at: at + segment.nbytes]], segment.offset)
        finally:
            os.close(fd)
    return torch.frombuffer(data, dtype=torch.uint8)


def load_decoded_experts(model: torch.nn.Module, checkpoint: CheckpointIndex) -> None:
    """Overwrites every routed expert of `model` with the decoding of the quantized checkpoint's."""
    dtype = next(model.parameters()).dtype
    decoder = ExpertDecoder(checkpoint.codec, checkpoint.experts.layout, dtype)
    for block in checkpoint.blocks:
        module = model.get_submodule(block.experts_path)
        for expert in range(checkpoint.topology.num_experts):
            location = checkpoint.experts.locations[(block.moe_index, expert)]
            weights = decoder(checkpoint.experts.views(read_expert(location)))
            with torch.no_grad():
                for param, value in weights.items():
                    checkpoint.adapter.expert_tensor(module, expert, param).copy_(value)


def _logits(model: torch.nn.Module, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=ids[None]).logits[0, :-1].double() for ids in sequences]  # [n - 1, V] each


def measure_error(source: str | Path, quantized: str | Path, prompts: Sequence[str],
                  new_tokens: int = 16) -> QuantError:
    """The error of the quantized copy against its source over `prompts` (see the module docstring)."""
    checkpoint = build_index(quantized)
    model = getattr(transformers, checkpoint.adapter.auto_class).from_pretrained(source).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    encoded = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in prompts]
    sequences = [model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                do_sample=False)[0] for ids in encoded]
    reference = _logits(model, sequences)
    load_decoded_experts(model, checkpoint)
    return compare(reference, _logits(model, sequences))


def compare(reference: list[torch.Tensor], quantized: list[torch.Tensor]) -> QuantError:
    """QuantError of matching lists of [n, V] logits."""
    ref, got = torch.cat(reference), torch.cat(quantized)  # [N, V]
    log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [N]
    chosen = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)  # [N]: the reference's logit there
    agree = (chosen == ref.max(-1).values).double().mean()  # where the reference's best logits tie, any agrees
    return QuantError(ref.shape[0], float(agree), float(kl.mean()), float((ref - got).abs().max()))
