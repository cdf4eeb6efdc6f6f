"""Turns a batch of sequences into forward passes: step plans (what to run) and model runners (how).

A `StepPlan` is a plain record of one iteration's inputs: a prefill of every prompt (left padded)
or one decode token per sequence. A `BatchCache` is one batch's past (the model's KV cache, each
row's cached positions, an encoder-decoder's encoder outputs); the scheduler owns it and hands it
to each step. A runner holds no batch state: it builds plans and calls the model the way
`transformers`' greedy `generate` does (same position ids, masks, cache), so that tokens match.
Runners are registered by the adapter's `auto_class`; they know no policy, no family and no scheduler.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from transformers import DynamicCache, EncoderDecoderCache

from moestream.events import IterationContext
from moestream.families.derive import text_part
from moestream.registry import Registry
from moestream.runtime.host_reads import upload
from moestream.runtime.publisher import Publisher, RowContext


class TokenSampler(Protocol):
    """Chooses one sequence's tokens and may end it early (sampling, stop strings, cancellation)."""

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from the sequence's logits [V]."""

    def stop_reason(self, output_ids: list[int]) -> str | None:
        """Why the sequence ends after its newest token ("abort", "stop"), or None."""

    @property
    def cancelled(self) -> bool:
        """Whether the sequence was cancelled (it ends before the next step)."""


NO_TOKEN_LIMIT = 1 << 62  # a sequence's max_tokens when its caller sets none


@dataclass(eq=False)
class Sequence:
    """One prompt and what has been generated for it; sampler (None: greedy) chooses its tokens."""

    seq_id: int
    prompt_ids: list[int]
    max_tokens: int = NO_TOKEN_LIMIT  # tokens to generate at most
    sampler: TokenSampler | None = None
    ignore_eos: bool = False  # generate past end-of-sequence tokens, up to max_tokens (benchmarks)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    arrived: float = 0.0  # when its request arrived (a batching rule may wait for company)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BatchCache:
    """One batch's past, owned by the scheduler."""

    kv: Any = None  # the model's KV cache (None: the runner makes one)
    mask: torch.Tensor | None = None  # [B, W] each row's cached positions (an encoder-decoder's: its encoder's)
    encoder_outputs: Any = None


@dataclass(frozen=True)
class StepPlan:
    step: int
    is_prefill: bool
    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] (prefill) or [B, past + 1] (decode)
    position_ids: torch.Tensor  # [B, S]
    rows: RowContext  # the B * S rows of the forward pass
    ctx: IterationContext  # the iteration's real tokens (padding and finished sequences excluded)


def _rows_and_ctx(step: int, seqs: list[Sequence], input_ids: np.ndarray, positions: np.ndarray,
                  active: np.ndarray, is_prefill: bool) -> tuple[RowContext, IterationContext]:
    batch, width = input_ids.shape
    seq_ids = np.repeat(np.array([s.seq_id for s in seqs], dtype=np.int64), width)  # [B * S]
    rows = RowContext(seq_ids, positions.reshape(-1), active.reshape(-1))
    keep = rows.active
    ctx = IterationContext(step=step, seq_ids=rows.seq_ids[keep], positions=rows.positions[keep],
                           is_prefill=is_prefill, token_ids=input_ids.reshape(-1)[keep])
    return rows, ctx


def _decode_rows(step: int, seqs: list[Sequence], positions: np.ndarray) -> tuple:
    """(ids [B, 1], rows, ctx): each sequence's newest token at its host position [B, 1] (a finished one runs none)."""
    ids = np.array([[s.output_ids[-1]] for s in seqs], dtype=np.int64)
    return ids, *_rows_and_ctx(step, seqs, ids, positions, np.array([[not s.finished] for s in seqs]), False)


class ModelRunner:
    """Runs plans through one model, over the batch cache it is handed; returns next-token logits [B, V]."""

    records_traces: ClassVar[bool] = True  # every MoE layer routes exactly the iteration's tokens
    per_sequence_cache: ClassVar[bool] = False  # runs batches merged from per-sequence caches (runtime/kv.py)

    def __init__(self, model: torch.nn.Module, publisher: Publisher, pad_id: int, device: str):
        self.model = model
        self.publisher = publisher
        self.pad_id = pad_id
        self.device = device

    def prefill(self, step: int, seqs: list[Sequence]) -> StepPlan:
        """All prompts at once, left padded as a tokenizer with padding_side='left' would."""
        width = max(len(s.prompt_ids) for s in seqs)
        ids = np.full((len(seqs), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for row, seq in enumerate(seqs):
            ids[row, width - len(seq.prompt_ids):] = seq.prompt_ids
            mask[row, width - len(seq.prompt_ids):] = 1
        positions = np.where(mask == 0, 0, mask.cumsum(-1) - 1)  # [B, S]
        rows, ctx = _rows_and_ctx(step, seqs, ids, positions, mask.astype(bool), True)
        device = self.device
        return StepPlan(step, True, upload(ids, device), upload(mask, device), upload(positions, device), rows, ctx)

    def decode(self, step: int, seqs: list[Sequence], cache: BatchCache) -> StepPlan:
        raise NotImplementedError

    def run(self, plan: StepPlan, cache: BatchCache) -> torch.Tensor:
        raise NotImplementedError

    def _forward(self, rows: RowContext, module: torch.nn.Module | None = None, **inputs):
        self.publisher.set_rows(rows)
        try:
            return (module or self.model)(**inputs)
        finally:
            self.publisher.set_rows(None)


RUNNERS: Registry[ModelRunner] = Registry("model runner")


def _next_logits(out) -> torch.Tensor:
    return out.logits[:, -1, :].float()


def _accepts(model: torch.nn.Module, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def _cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """The KV cache as the model's forward names it: `cache` (newer transformers 5.x), else
    `past_key_values` (earlier 5.x, which swallow an unknown `cache=` into **kwargs and cache nothing)."""
    return {"cache": cache} if _accepts(model, "cache") else {"past_key_values": cache}


def _returned_cache(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


@RUNNERS.register("AutoModelForCausalLM")
class CausalRunner(ModelRunner):
    """A decoder's tokens; with no cache yet, the model makes its own (hybrid models keep recurrent
    states beside their keys and values, in a cache of their own class)."""

    per_sequence_cache = True

    def decode(self, step: int, seqs: list[Sequence], cache: BatchCache) -> StepPlan:
        """One token per sequence after its cached positions [B, W], each row at its own position, as
        `generate` extends a left-padded batch; the host's positions are the sequences' cached tokens."""
        past_mask = cache.mask
        cached = np.array([[len(s.prompt_ids) + len(s.output_ids) - 1] for s in seqs], dtype=np.int64)  # [B, 1]
        positions = past_mask.sum(-1, keepdim=True)  # [B, 1] on the device: what the model sees
        mask = torch.cat([past_mask, past_mask.new_ones((len(seqs), 1))], dim=-1)  # [B, W + 1]
        ids, rows, ctx = _decode_rows(step, seqs, cached)
        return StepPlan(step, False, upload(ids, past_mask.device), mask, positions, rows, ctx)

    def run(self, plan: StepPlan, cache: BatchCache) -> torch.Tensor:
        extra = {"logits_to_keep": 1} if _accepts(self.model, "logits_to_keep") else {}
        if cache.kv is not None:
            extra |= _cache_kwargs(self.model, cache.kv)
        out = self._forward(plan.rows, input_ids=plan.input_ids, attention_mask=plan.attention_mask,
                            position_ids=plan.position_ids, use_cache=True, **extra)
        cache.kv, cache.mask = _returned_cache(out), plan.attention_mask
        return _next_logits(out)  # [B, V]


@RUNNERS.register("AutoModelForImageTextToText")
class TextOfMultimodalRunner(CausalRunner):
    """The text part of a multimodal model, run on input ids alone."""


@RUNNERS.register("AutoModelForMultimodalLM")
class TextOfOmniRunner(CausalRunner):
    """The text part of a model that also takes audio or video (Qwen3-Omni: its thinker), on input ids alone."""

    def __init__(self, model: torch.nn.Module, publisher: Publisher, pad_id: int, device: str):
        super().__init__(text_part(model), publisher, pad_id, device)


@RUNNERS.register("AutoModelForSeq2SeqLM")
class Seq2SeqRunner(ModelRunner):
    """Encodes the prompts in the prefill step, then decodes from the decoder start token (position 0). The
    encoder and decoder route different tokens, so an iteration is not one row per token: no traces."""

    records_traces = False

    def decode(self, step: int, seqs: list[Sequence], cache: BatchCache) -> StepPlan:
        """cache.mask is the encoder's mask [B, S]; decoder positions count the tokens generated."""
        positions = np.array([[len(s.output_ids)] for s in seqs], dtype=np.int64)  # [B, 1]
        ids, rows, ctx = _decode_rows(step, seqs, positions)
        return StepPlan(step, False, upload(ids, self.device), cache.mask, upload(positions, self.device), rows, ctx)

    def run(self, plan: StepPlan, cache: BatchCache) -> torch.Tensor:
        decoder_ids, rows = plan.input_ids, plan.rows
        if plan.is_prefill:
            self._encode(plan, cache)
            decoder_ids, rows = self._start(plan)
        out = self._forward(rows, encoder_outputs=cache.encoder_outputs, attention_mask=cache.mask,
                            decoder_input_ids=decoder_ids, use_cache=True, **_cache_kwargs(self.model, cache.kv))
        cache.kv = _returned_cache(out)
        return _next_logits(out)  # [B, V]

    def _encode(self, plan: StepPlan, cache: BatchCache) -> None:
        config = self.model.config
        cache.kv = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        cache.mask = plan.attention_mask
        cache.encoder_outputs = self._forward(plan.rows, self.model.get_encoder(), input_ids=plan.input_ids,
                                              attention_mask=plan.attention_mask)

    def _start(self, plan: StepPlan) -> tuple[torch.Tensor, RowContext]:
        """The decoder's first input [B, 1]: every sequence's start token, at decoder position 0."""
        batch = plan.input_ids.shape[0]
        start = self.model.generation_config.decoder_start_token_id
        start = self.model.config.decoder_start_token_id if start is None else start
        ids = torch.full((batch, 1), int(start), dtype=torch.long, device=plan.input_ids.device)
        seq_ids = plan.rows.seq_ids.reshape(batch, -1)[:, 0]
        return ids, RowContext(seq_ids, np.zeros(batch, dtype=np.int64), np.ones(batch, dtype=bool))
