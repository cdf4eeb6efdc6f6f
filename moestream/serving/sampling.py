"""How tokens are chosen: `SamplingParams` (greedy, temperature, top-k, top-p, seed, stop strings,
max tokens) and `SequenceSampler`, the engine's token sampler of one sequence.

Each sequence samples with its own torch generator seeded from its `seed`, so a sequence's tokens do
not depend on the other sequences of its batch. Greedy sequences take the argmax, exactly as the
engine does without a sampler. It knows no model and no server; text comes through a `decode` callable.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from moestream.errors import MoestreamError

MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 100.0


class SamplingError(MoestreamError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # the k most likely tokens only (0: all)
    seed: int | None = None  # a sequence's generator seed (None: a fresh random seed)
    stop: tuple[str, ...] = ()  # strings that end the sequence; trimmed from the text
    ignore_eos: bool = False  # go on past end-of-sequence tokens up to max_tokens (as vLLM's, for benchmarks)

    def __post_init__(self):
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
                 f"temperature must lie in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must lie in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _require(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
                 f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SamplingError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _stop_strings(stop) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    _require(all(isinstance(s, str) and s for s in stop), "stop strings must be non-empty strings")
    _require(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return stop


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits [V] at the params' temperature, top-k and top-p."""
    scaled = logits.float().cpu() / params.temperature  # [V]
    if 0 < params.top_k < scaled.numel():
        threshold = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_index(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in text (None: none occurs)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


@dataclass
class SequenceSampler:
    """One sequence's TokenSampler (runtime/runner.py): a stop string or a cancellation (any thread) ends it."""

    params: SamplingParams
    decode: Callable[[list[int]], str]
    stopped: threading.Event = field(default_factory=threading.Event)  # set: the sequence ends (its request's)
    generator: torch.Generator = field(init=False)

    def __post_init__(self):  # no seed: a fresh random one (torch's non-deterministic Generator.seed())
        seed = torch.Generator().seed() if self.params.seed is None else self.params.seed
        self.generator = torch.Generator().manual_seed(seed)

    def choose(self, logits: torch.Tensor) -> int:
        return int(logits.argmax()) if self.params.greedy else sample_token(logits, self.params, self.generator)

    def stop_reason(self, output_ids: list[int]) -> str | None:
        if self.cancelled:
            return "abort"
        if self.params.stop and stop_index(self.decode(output_ids), self.params.stop) is not None:
            return "stop"
        return None

    def cancel(self) -> None:
        """Ends the sequence before its next step (safe from any thread)."""
        self.stopped.set()

    @property
    def cancelled(self) -> bool:
        return self.stopped.is_set()

    def text(self, output_ids: list[int]) -> str:
        """The sequence's text with everything from its first stop string on removed."""
        text = self.decode(output_ids)
        cut = stop_index(text, self.params.stop)
        return text if cut is None else text[:cut]
