"""The settings a user chooses, each declared once with its default, help text and bounds: EngineConfig
(builds the store's StoreConfig), and serving's WorkerConfig, which nests the batcher's BatchingConfig.

Validated on construction, so that a bad setting fails before anything is loaded; the CLI's flags are
generated from these fields (moestream.settings). Imports no torch, so that the CLI refuses bad flags
before its heavy imports; knows nothing of how the settings are carried out.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field

from moestream.budget import Budget, parse_size
from moestream.errors import BudgetError, MoestreamError
from moestream.memory_plan import AUTO
from moestream.settings import check, setting

_DEVICE = re.compile(r"(?P<type>cpu|cuda)(:(?P<index>\d+))?")
_CUDA_DRIVERS = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")  # the driver's library on Linux, Windows
QUANT_KERNELS = ("exact", "packed-cpu")  # moestream.quant.kernels.QUANT_KERNELS, named here without torch


def parse_device(device) -> str:
    """'cpu' or 'cuda:N' of a device that exists, or one line saying why not. A machine without an
    NVIDIA driver is refused without importing torch; torch is asked only where a driver is present."""
    match = _DEVICE.fullmatch(str(device).strip()) if device is not None else None  # a str or a torch.device
    if match is None:
        raise BudgetError(f"unknown device {device!r}; use 'cpu' or 'cuda[:N]'")
    if match["type"] == "cpu":
        return "cpu"
    if not _has_cuda_driver():
        raise BudgetError(f"device {device!r} requested but CUDA is not available (no NVIDIA driver)")
    import torch  # here: the CLI's parser imports no torch

    index = int(match["index"] or 0)
    if not torch.cuda.is_available():
        raise BudgetError(f"device {device!r} requested but CUDA is not available (torch {torch.__version__})")
    if index >= torch.cuda.device_count():
        raise BudgetError(f"device {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return "cuda" if match["index"] is None else f"cuda:{index}"


def _has_cuda_driver() -> bool:
    """Whether the NVIDIA driver's library loads (loading it starts no CUDA context)."""
    for name in _CUDA_DRIVERS:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def store_rules(device_budget, host_budget, device, name: str) -> tuple[Budget, Budget, str]:
    """The budgets of the two tiers (a Budget or its text) and the device, as the store reads them, or one
    line naming `name` (the device budget's field) saying why not: the rules of the store's settings, applied
    by EngineConfig and by a StoreConfig made in Python alike."""
    device_budget, host_budget = Budget.parse(device_budget), Budget.parse(host_budget)
    if device_budget.ratio == 0.0:
        raise BudgetError(f"{name}: a device budget ratio must be in (0, 1], got 0")
    return device_budget, host_budget, parse_device(device)


def tier_budget(text: str, flag: str) -> "Budget | str":
    """A tier's budget flag: a Budget, or `auto` (resolved by the CLI from the memory available)."""
    return AUTO if text == AUTO else Budget.parse(text, flag)


def kv_size(text: str, flag: str) -> int:
    """A KV budget flag: a size such as 512MiB, in bytes (a ratio is refused; refusals suggest sizes only)."""
    return Budget.parse(text, flag, ratios=False).size_bytes


@dataclass(frozen=True)
class EngineConfig:
    device: str = setting("cpu", "cpu or cuda[:N]: where the dense part and the device tier live")
    num_threads: int = setting(0, "threads that compute (torch's intra-op threads; default 0: this machine's "
                                  "cores less the engine's own I/O and predictor threads, at most torch's count)",
                               flag="--threads", short="-t", minimum=0)
    expert_budget: Budget | str = setting(
        Budget(ratio=0.25), "device-tier budget: a ratio of all routed-expert bytes (0.25, 25%%), a size "
        "(512MiB), or auto (what the memory available leaves: see `moestream plan`)", parse=tier_budget)
    host_budget: Budget | str = setting(
        Budget(size_bytes=0), "host-tier budget, same forms (default 0: no host tier); on the CPU without --sync "
        "it joins the expert budget, since host and device memory are one tier there", parse=tier_budget)
    policy: str = setting("lru", "prefetch/eviction policy by name (moestream.policies)")
    horizon_layers: int = setting(2, "how many MoE layers ahead the policy predicts after each layer", minimum=0)
    direct_io: bool = setting(True, "read experts through the page cache, not O_DIRECT", flag="--buffered-io")
    publish_gate_probs: bool = False  # add the router's full distribution to routing events (--record-trace)
    publish_hidden: bool = False  # add router inputs to routing events even if no policy asks (--record-hidden)
    predictor_dir: str | None = setting(None, "trained predictor of the policy (from `moestream train-predictor`)")
    sync: bool = setting(False, "transfer experts on the compute thread (the on-demand baseline; default: async)")
    replay_routing: str | None = setting(None, "follow this trace's routing instead of the router's (measurement "
                                         "only; outputs are labelled as replayed)", metavar="TRACE")
    chunk_bytes: int = setting(0, "largest piece of one expert transfer, e.g. 256KiB (default 0: one weight matrix)",
                               flag="--chunk-size", parse=parse_size, minimum=0)
    chunks_in_flight: int = setting(8, "speculative chunks read together, the most a demand miss waits behind",
                                    minimum=1)
    reorder: bool = setting(True, "compute a layer's experts in expert order instead of resident ones first",
                            flag="--no-reorder")
    transfer_timeout_s: float = setting(60.0, "longest wait for expert bytes before it fails", above=0)
    background_predictor: bool = setting(True, "run a slow policy's predictor on the compute thread, not a worker "
                                          "thread, so that its plans do not depend on the clock (bench fidelity)",
                                          flag="--inline-predictor")
    link_gbps: float = setting(0.0, "the disk's read bandwidth (GB/s) for the planner's modelled link, with "
                                    "--layer-ms (default 0: the planner sees no link)", minimum=0)
    layer_ms: float = setting(0.0, "one MoE layer's compute (ms), its experts resident, for the planner's "
                                   "modelled link (default 0: none)", minimum=0)
    native_gemv: bool = setting(False, "on the CPU, a step of one row (a decode step of one sequence) runs its bf16 "
                                       "products with torch's native kernel, not oneDNN's (a process-wide switch; "
                                       "attention keeps oneDNN, which is faster there): "
                                       "about 1.6x faster at real expert sizes, but the last bit differs from "
                                       "transformers' (oneDNN) in about 0.02%% of outputs, so tokens may too")
    host_compute: str = setting("off", "where a device-tier miss in the host tier computes: off (on the device, "
                                       "after its copy), share:F (a share F of them on the host) or default (the "
                                       "placement that ends the layer soonest by the measured costs); keeps a host "
                                       "tier apart on the CPU", metavar="RULE")
    host_threads: int = setting(1, "threads that compute experts on the host (with --host-compute)")
    quant_kernel: str = setting("exact", "how quantized experts compute: exact (decoded into the compute dtype, then "
                                         "the MLP: bit for bit transformers' model with the experts dequantized) or "
                                         "packed-cpu (GPTQ int4/int8 experts from their packed bytes on the CPU, as "
                                         "`quantize --layout gptq` writes them: faster, but not bit-identical, so "
                                         "tokens may differ)", metavar="KERNEL")

    def __post_init__(self):
        from moestream.policies import POLICIES  # imported here: the CLI's parser stays light
        from moestream.policies.compute_placement import compute_rule
        from moestream.threads import available_cores

        check(self)
        compute_rule(self.host_compute)  # refuses an unknown rule naming the flag
        if self.quant_kernel not in QUANT_KERNELS:
            raise MoestreamError(f"unknown --quant-kernel {self.quant_kernel!r}; choose from {', '.join(QUANT_KERNELS)}")
        if not 1 <= self.host_threads <= available_cores():
            raise MoestreamError(f"--host-threads {self.host_threads}: must be between 1 and this machine's "
                                 f"{available_cores()} cores")
        rules = store_rules(self.expert_budget, self.host_budget, self.device, "expert_budget")
        for name, value in zip(("expert_budget", "host_budget", "device"), rules):
            object.__setattr__(self, name, value)
        if POLICIES.get(self.policy).offline:
            raise MoestreamError(f"policy {self.policy!r} needs the future routing of a trace; "
                                 "it runs in the simulator only")


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = setting(16, "sequences per decode step", minimum=1)
    max_num_seqs: int = setting(0, "running sequences at most; above the batch size, batches decode in turn "
                                   "(default 0: the batch size)", minimum=0)
    kv_budget_bytes: int = setting(1 << 30, "KV cache the running sequences may reserve (default 1GiB)",
                                   flag="--kv-budget", parse=kv_size, minimum=1)
    prefill_token_budget: int = setting(2048, "prompt tokens per prefill step (one longer prompt runs alone)",
                                        minimum=1)
    token_scheduler: str = setting("fifo", "how running sequences form batches: fifo or expertflow "
                                           "(routing similarity)")
    max_prefill_delay_ms: float = setting(
        0.0, "while sequences decode, a new prompt waits up to this long (or until they finish) and prefills "
        "with the prompts that came meanwhile: fewer sweeps of the experts between decode steps, a later "
        "first token (default 0: at the next step)", minimum=0)

    def __post_init__(self):
        from moestream.runtime.scheduling.token_scheduler import TOKEN_SCHEDULERS

        check(self)
        if self.token_scheduler not in TOKEN_SCHEDULERS:
            raise MoestreamError(f"unknown token scheduler {self.token_scheduler!r}; "
                                 f"choose from {', '.join(TOKEN_SCHEDULERS.names())}")

    @property
    def num_seqs(self) -> int:
        return self.max_num_seqs or self.max_batch_size


@dataclass(frozen=True)
class WorkerConfig:
    max_wait_ms: float = setting(20.0, "how long the first request reaching an idle engine waits for others",
                                 minimum=0)
    max_queue: int = setting(64, "waiting requests beyond which 429 is answered", minimum=1)
    max_queue_wait_ms: float = setting(60_000.0, "a request not started within this is answered 503", above=0)
    batching: BatchingConfig = field(default_factory=BatchingConfig)

    def __post_init__(self):
        check(self)
