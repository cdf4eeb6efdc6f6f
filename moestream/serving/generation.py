"""One static batch of requests through the engine with per-request sampling (the offline `LLM`
API), and `TextStream`, which the continuous batcher shares: text increments with stop strings held
back until they can no longer begin one. It knows no HTTP and no queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moestream.serving.sampling import BatchSampler, SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    text: str  # generated text, stop string and what follows removed
    token_ids: list[int]  # generated ids (EOS kept when emitted)
    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int


@dataclass(frozen=True)
class TextDelta:
    row: int
    text: str  # new text since the row's previous delta
    finished: bool
    finish_reason: str | None = None


class TextStream:
    """The text of one row as it grows, released only where it is final (no partial character and
    no possible beginning of a stop string at its end)."""

    def __init__(self, stop: tuple[str, ...]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        if not finished and text[self.sent: end].endswith("\ufffd"):
            end = self.sent
        piece, self.sent = text[self.sent: end], max(self.sent, end)
        return piece


def run_batch(engine, prompt_ids: list[list[int]], params: list[SamplingParams],
              on_delta: Callable[[TextDelta], None] | None = None,
              on_sampler: Callable[[BatchSampler], None] | None = None) -> list[CompletionOutput]:
    """Generates every prompt (token ids) with its own params; on_delta gets each row's new text
    after each step, on_sampler the batch's sampler before the first step (to cancel rows)."""
    decode = _decoder(engine)
    sampler = BatchSampler(list(params), decode)
    if on_sampler is not None:
        on_sampler(sampler)
    streams = [TextStream(p.stop) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    done = [False] * len(params)

    def on_tokens(new: list[int | None]) -> None:
        for row, token in enumerate(new):
            if token is None or done[row]:
                continue
            outputs[row].append(token)
            done[row] = sampler.finished(row)
            if on_delta is not None:
                piece = streams[row].delta(sampler.text(row, outputs[row]), done[row])
                reason = sampler.finish_reason(row) if done[row] else None
                on_delta(TextDelta(row, piece, done[row], reason))

    result = engine.generate(prompt_ids, max_new_tokens=max(p.max_tokens for p in params),
                             on_tokens=on_tokens, sampler=sampler)
    return [CompletionOutput(sampler.text(row, ids), list(ids), sampler.finish_reason(row), len(prompt_ids[row]))
            for row, ids in enumerate(result.token_ids)]


def _decoder(engine) -> Callable[[list[int]], str]:
    tokenizer = engine.tokenizer
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
