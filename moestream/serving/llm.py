"""The offline Python API in the spirit of vLLM: `LLM(model_dir, **options).generate(prompts, SamplingParams(...))`
-> one `RequestOutput` per prompt. The prompts go to the scheduler the server's batcher uses (`open_scheduler`),
admitted and batched as the server does; under routing replay every output says so (`replayed`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence as Seq

from moestream.config import BatchingConfig
from moestream.errors import MoestreamError
from moestream.runtime import Engine, EngineConfig
from moestream.runtime.scheduling.continuous import open_scheduler
from moestream.runtime.scheduling.scheduler import seq_positions
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

    def __init__(self, model_dir: str | Path, **options):
        """options: EngineConfig fields (expert_budget, host_budget, policy, device, ...) and BatchingConfig
        fields (max_batch_size, max_num_seqs, kv_budget_bytes, token_scheduler, ...)."""
        self.batching = BatchingConfig(**{name: options.pop(name) for name in _BATCHING if name in options})
        self.engine = Engine(model_dir, EngineConfig(**options))
        try:
            self.scheduler = open_scheduler(self.engine, self.batching)
        except BaseException:
            self.engine.close()
            raise

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Text or token-id prompts; one SamplingParams for all, or one per prompt (default: greedy, 16 tokens)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        tokenizer = self.engine.tokenizer
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        seqs = [self.engine.new_sequence(ids, p.max_tokens, SequenceSampler(p, decode), p.ignore_eos)
                for ids, p in zip(self.engine.prompt_ids(prompts), params)]
        for seq in seqs:
            self.scheduler.admission.check(seq_positions(seq))  # all refused before any runs
        try:
            for seq in seqs:
                self.scheduler.add(seq)
            while self.engine.step(self.scheduler) is not None:
                pass
        finally:  # what an error or an interrupt left ends here, not in the next call
            for seq in [s for s in seqs if not s.finished]:
                self.scheduler.finish(seq, "abort")
        replayed = self.engine.replay is not None
        return [RequestOutput(prompt, s.sampler.text(s.output_ids), list(s.output_ids), s.finish_reason,
                              len(s.prompt_ids), replayed) for prompt, s in zip(prompts, seqs)]

    def close(self) -> None:
        try:
            self.scheduler.close()
        finally:
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_BATCHING = {f.name for f in fields(BatchingConfig)}


def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    params = list(sampling_params)
    if len(params) != count:
        raise MoestreamError(f"{len(params)} sampling params for {count} prompts")
    return params
