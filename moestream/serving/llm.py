"""The offline Python API in the spirit of vLLM: `LLM(model_dir, **engine options).generate(prompts,
SamplingParams(...))` -> one `RequestOutput` per prompt. The prompts are added to the engine's
scheduler, which runs them in static batches of max_batch_size, and it steps until all have ended.
Under routing replay (replay_routing=TRACE) every output says so (`replayed`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

from moestream.errors import MoestreamError
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.scheduler import StaticBatches
from moestream.serving.sampling import SamplingParams, SequenceSampler


@dataclass(frozen=True)
class RequestOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    num_prompt_tokens: int
    replayed: bool = False  # the routing came from a recorded trace (replay_routing): for measurement only


class LLM:
    """A checkpoint served offline with its experts offloaded; close() (or a with block) releases it."""

    def __init__(self, model_dir: str | Path, max_batch_size: int = 16, **engine_options):
        """engine_options: EngineConfig fields (expert_budget, host_budget, policy, device, ...)."""
        if max_batch_size < 1:
            raise MoestreamError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.engine = Engine(model_dir, EngineConfig(**engine_options))

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Text or token-id prompts; one SamplingParams for all, or one per prompt (default: greedy, 16 tokens)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        tokenizer = self.engine.tokenizer
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        seqs = [self.engine.new_sequence(ids, p.max_tokens, SequenceSampler(p, decode), p.ignore_eos)
                for ids, p in zip(self.engine.prompt_ids(prompts), params)]
        scheduler = self.engine.scheduler(StaticBatches(self.max_batch_size))
        for seq in seqs:
            scheduler.add(seq)
        while self.engine.step(scheduler) is not None:
            pass
        replayed = self.engine.replay is not None
        return [RequestOutput(prompt, s.sampler.text(s.output_ids), list(s.output_ids), s.finish_reason,
                              len(s.prompt_ids), replayed) for prompt, s in zip(prompts, seqs)]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    params = list(sampling_params)
    if len(params) != count:
        raise MoestreamError(f"{len(params)} sampling params for {count} prompts")
    return params
