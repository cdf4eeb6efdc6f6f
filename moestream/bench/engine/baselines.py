"""The baselines of `bench engine`, each a run kind of `RUNS` beside our engine's: plain transformers with
every weight in memory ("transformers": the all-resident reference of issue 44, on every device), and
transformers with accelerate's disk offload at the same memory ("hf-accelerate": the CPU baseline). Each
returns the figures of `spec.summarize` and the tokens it generated. `PlainModel` is the first's model and
greedy step loop.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moestream.bench.engine.runners import RUNS, CpuClock
from moestream.bench.engine.spec import Counters, RunSpec, dense_bytes, shards, step_times_ms, summarize
from moestream.budget import Budget

__all__ = ["RUNS"]
OURS_ONLY = {"stall_ms_per_token": None, "hit_rate": None, "host_bytes_per_token": None}  # no store of ours


class PlainModel:
    """The unmodified transformers model in the checkpoint's dtype, every weight in memory, its own experts
    implementation, run by the engine's greedy step loop (outside `generate`, with the KV cache)."""

    def __init__(self, model_dir: Path, device: str):
        import transformers

        from moestream.checkpoint.index import build_index
        from moestream.runtime.scheduling.scheduler import eos_ids

        self.checkpoint = build_index(model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        auto_class = getattr(transformers, self.checkpoint.adapter.auto_class)
        self.model = auto_class.from_pretrained(model_dir, dtype="auto").to(device).eval()
        self.eos = eos_ids(self.model.generation_config)
        self.device = device

    def decode(self, prompt: str, max_new_tokens: int):
        """(the greedy new token ids, a StepClock marked at the end of each step with the device synchronized,
        a CpuClock of the steps)."""
        import torch

        from moestream.runtime.metrics import StepClock
        from moestream.runtime.publisher import Publisher
        from moestream.runtime.runner import RUNNERS, BatchCache, Sequence

        seqs = [Sequence(0, list(self.tokenizer(prompt)["input_ids"]))]
        runner = RUNNERS.create(self.checkpoint.adapter.auto_class, self.model, Publisher(), 0, self.device)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.startswith("cuda") else (lambda: None)
        clock, cpu, cache = StepClock(), CpuClock(), BatchCache()
        with torch.inference_mode():
            plan = runner.prefill(0, seqs)
            while plan is not None:
                cpu.begin_iteration()
                seqs[0].output_ids.append(int(runner.run(plan, cache).argmax(dim=-1)[0]))
                done = seqs[0].output_ids[-1] in self.eos or len(seqs[0].output_ids) >= max_new_tokens
                if done:
                    cpu.end_sequence()
                sync()
                clock.mark()
                plan = None if done else runner.decode(len(clock.marks), seqs, cache)
        return seqs[0].output_ids, clock, cpu


@RUNS.register("transformers")
class PlainTransformersRun:
    """The checkpoint as plain transformers (its dtype, its own experts implementation, every weight loaded
    normally on the device; PlainModel): a greedy decode loop with the KV cache outside `generate`, each step
    timed with the device synchronized (and in process CPU time), one generation per prompt."""

    def run(self, spec: RunSpec) -> dict:
        model = PlainModel(Path(spec.model), spec.device)
        counters, token_ids = Counters(), []
        for prompt in spec.prompts:
            ids, clock, cpu = model.decode(prompt, spec.max_new_tokens)
            counters.ttft_ms.append(clock.ttft_ms)
            if len(ids) > 1:
                counters.tpot_ms.append(clock.tpot_ms)
            counters.step_ms.append(step_times_ms(clock.marks))
            counters.cpu_step_ms.append(step_times_ms(cpu.marks[1:]))
            counters.decode_tokens += len(ids) - 1
            counters.prompt_tokens += len(model.tokenizer(prompt)["input_ids"])
            token_ids.append(ids)
        config = model.model.config
        return summarize(counters, 0.0, 0.0, spec.warmup_steps) | OURS_ONLY | {
            "replayed": False, "token_ids": token_ids, "dtype": str(model.model.dtype).removeprefix("torch."),
            "experts_implementation": getattr(config, "_experts_implementation", None)}


@RUNS.register("hf-accelerate")
class HfAccelerateRun:
    """transformers with accelerate's disk offload: what fits in dense part + budget (+ host budget: our run's
    memory) stays in memory, the rest of the weights is read from an offload folder at every forward. Routing
    is the model's own (no replay without patching transformers); offloaded modules hold a whole layer's experts, so the bytes
    read do not depend on routing."""

    def run(self, spec: RunSpec) -> dict:
        import transformers

        from moestream.bench.tools.bandwidth import drop_page_cache
        from moestream.checkpoint.index import build_index

        topology = build_index(spec.model).topology
        memory = dense_bytes(spec.model, topology) + sum(Budget.parse(budget).resolve(topology.total_expert_bytes)
                                                         for budget in (spec.budget, spec.host_budget))
        folder = Path(spec.scratch_dir) / "offload"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec.model, device_map="auto", max_memory={"cpu": memory}, offload_folder=str(folder), dtype="auto").eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(spec.model)
        os.sync()  # the offload folder was just written: dirty pages cannot be dropped
        drop_page_cache([*shards(spec.model), *folder.glob("*")])
        counters = Counters()
        for prompt in spec.prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # [1, S]
            _generate_timed(model, ids, spec.max_new_tokens, counters)
        return summarize(counters, 0.0, 0.0, spec.warmup_steps) | OURS_ONLY | {"replayed": False}


def _generate_timed(model, ids, max_new_tokens: int, counters: Counters) -> None:
    """One greedy generation, timed per step by a logits processor; disk bytes of the decode steps."""
    import torch
    from transformers import LogitsProcessorList

    marks = StepMarks()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([marks]))
    generated = out.shape[1] - ids.shape[1]
    counters.ttft_ms.append((marks.times[0] - started) * 1e3)
    if generated > 1:
        counters.tpot_ms.append((marks.times[-1] - marks.times[0]) * 1e3 / (len(marks.times) - 1))
        counters.disk_bytes += _read_bytes() - marks.read_bytes_at_first
        counters.decode_tokens += generated - 1
    counters.step_ms.append(step_times_ms(marks.times))
    counters.prompt_tokens += ids.shape[1]


class StepMarks:
    """A logits processor that notes when each step's logits are ready (and the disk bytes at the first)."""

    def __init__(self):
        self.times: list[float] = []
        self.read_bytes_at_first = 0

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if len(self.times) == 1:
            self.read_bytes_at_first = _read_bytes()
        return scores


def _read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0
