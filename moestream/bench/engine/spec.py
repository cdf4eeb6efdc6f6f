"""What one `bench engine` run is (`RunSpec`), the counters it keeps and the per-token figures it reports.

Plain data shared by the parent (plan, isolation) and the child process; knows no policy by name.
"""

from __future__ import annotations

import json
import resource
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moestream.config import EngineConfig
from moestream.procfs import status_mib
from moestream.read_fit import ReadBatchFit
from moestream.settings import same_as


@dataclass(frozen=True)
class RunSpec:
    """One run; the engine's settings it shares take EngineConfig's defaults (`same_as`)."""

    model: str
    budget: str  # expert budget: a ratio ("0.25") or a size
    kind: str = "engine"  # "engine" (ours), "hf-accelerate" or "transformers" (baselines.py)
    host_budget: str = "0"  # the host tier's (EngineConfig.host_budget), filled before timing (host.py)
    device: str = same_as(EngineConfig, "device")
    policy: str = same_as(EngineConfig, "policy")
    sync: bool = same_as(EngineConfig, "sync")
    reorder: bool = same_as(EngineConfig, "reorder")  # cache-aware reordering
    preload: bool = False  # fill the device tier before timing (the all-resident run)
    replay_routing: str | None = None
    predictor_dirs: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = 16
    warmup_steps: int = 3  # each generation's first decode steps, left out of steady_tpot_ms
    threads: int = 1
    direct_io: bool = same_as(EngineConfig, "direct_io")
    native_gemv: bool = same_as(EngineConfig, "native_gemv")
    scratch_dir: str = ""  # where hf-accelerate writes its offload folder
    link_gbps: float = same_as(EngineConfig, "link_gbps")  # the planner's modelled link: the bench's calibration
    layer_ms: float = same_as(EngineConfig, "layer_ms")
    background_predictor: bool = same_as(EngineConfig, "background_predictor")  # bench fidelity: False
    keep_embeddings: bool = False  # keep each iteration's embeddings a policy saw (bench fidelity replays them)
    host_compute: str = same_as(EngineConfig, "host_compute")  # where a device-tier miss in the host tier computes
    host_threads: int = same_as(EngineConfig, "host_threads")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        data = json.loads(text)
        return cls(**data | {"predictor_dirs": tuple(data["predictor_dirs"]), "prompts": tuple(data["prompts"])})


@dataclass
class Counters:
    """Store counters summed over the decode steps of every prompt."""

    hits: int = 0
    misses: int = 0
    disk_bytes: int = 0
    disk_reads: int = 0  # experts read from disk (into either tier)
    host_bytes: int = 0  # bytes copied up from the host tier into the device tier
    read_ms: float = 0.0  # time the disk reader was busy
    copy_ms: float = 0.0  # time the host -> device link was busy
    read_batches: int = 0  # batches of reads in flight together
    read_fit: ReadBatchFit = field(default_factory=ReadBatchFit)  # the synchronous store's read batches
    experts_computed: int = 0  # routed expert MLPs run
    host_computed: int = 0  # device-tier misses computed on the host, from their host slots (--host-compute)
    host_lane_ms: float = 0.0  # the tracer's "host compute" lane: the compute thread's time on the host's results
    host_lane_spans: int = 0  # its spans: layer steps that computed experts on the host
    expert_compute_ms: float = 0.0  # their wall time on the compute thread
    decode_tokens: int = 0
    prompt_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    step_ms: list[list[float]] = field(default_factory=list)  # each generation's decode steps
    cpu_step_ms: list[list[float]] = field(default_factory=list)  # the same in process CPU time


def step_times_ms(marks: list[float]) -> list[float]:
    """The decode steps' times (ms) from the marks at the end of each step (the prefill's first)."""
    return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]


def steady_tpot_ms(step_ms: list[list[float]], warmup_steps: int) -> float | None:
    """The median over generations of the mean decode step after the first warmup_steps (None: no generation
    had more steps than that)."""
    kept = [statistics.fmean(steps[warmup_steps:]) for steps in step_ms if len(steps) > warmup_steps]
    return statistics.median(kept) if kept else None


def shards(model: str | Path) -> list[Path]:
    return sorted(Path(model).glob("*.safetensors"))


def dense_bytes(model: str | Path, topology) -> int:
    """The checkpoint's bytes that are not routed experts."""
    return sum(p.stat().st_size for p in shards(model)) - topology.total_expert_bytes


def peak_rss_mib() -> float:
    """This process's peak resident set (MiB): Linux's VmHWM, which starts afresh at exec. getrusage's
    ru_maxrss does not: an exec'd child inherits the peak of the parent it was forked from."""
    peak = status_mib("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB (macOS: bytes)


def summarize(counters: Counters, stall_ms: float, transfer_ms: float, warmup_steps: int = 0) -> dict:
    """The per-token figures of a run from its decode counters (steady_tpot_ms: after each generation's
    first warmup_steps decode steps)."""
    tokens = max(counters.decode_tokens, 1)
    lookups = counters.hits + counters.misses
    return {
        "ttft_ms": statistics.median(counters.ttft_ms) if counters.ttft_ms else 0.0,
        "tpot_ms": statistics.median(counters.tpot_ms) if counters.tpot_ms else 0.0,
        # the mean decode step, over the tokens the stall per token is a part of (calibrate subtracts it)
        "decode_ms_per_token": sum(map(sum, counters.step_ms)) / tokens if counters.step_ms else None,
        "steady_tpot_ms": steady_tpot_ms(counters.step_ms, warmup_steps),
        "steady_cpu_tpot_ms": steady_tpot_ms(counters.cpu_step_ms, warmup_steps),
        "hit_rate": counters.hits / lookups if lookups else 1.0,
        "stall_ms_per_token": stall_ms / tokens,
        "overlap": max(0.0, 1.0 - stall_ms / transfer_ms) if transfer_ms > 0 else None,
        "bytes_per_token": counters.disk_bytes / tokens,
        "host_bytes_per_token": counters.host_bytes / tokens,
        "transfer_ms_per_token": transfer_ms / tokens,
        "expert_read_ms": counters.read_ms / counters.disk_reads if counters.disk_reads else None,
        "experts_per_read_batch": counters.disk_reads / counters.read_batches if counters.read_batches else None,
        "read_batch_line_ms": [1e3 * part for part in line] if (line := counters.read_fit.line()) else None,
        "routed_expert_ms": counters.expert_compute_ms / counters.experts_computed if counters.experts_computed
        else None,
        "decode_tokens": counters.decode_tokens,
        "prompt_tokens": counters.prompt_tokens,
        "expert_hits": counters.hits,
        "expert_misses": counters.misses,
        "host_computed": counters.host_computed,
        # the device-tier misses the host computed, of all of them (those the device fetched, and these)
        "host_compute_share": host_share(counters.host_computed, counters.misses),
        "host_lane_ms_per_token": counters.host_lane_ms / tokens,
        "host_lane_spans_per_token": counters.host_lane_spans / tokens,
    }


def host_share(host_computed: int, misses: int) -> float | None:
    """The share of device-tier misses computed on the host: host_computed / (host_computed + misses), where
    misses are those the device fetched (an expert computed on the host is no device lookup); None: no miss."""
    total = host_computed + misses
    return host_computed / total if total else None
