"""Cost models for the simulator: compute time per MoE layer and transfer time per link.

A cost model is plain numbers; the simulator turns them into virtual time. Presets: `pcie4-consumer`
(default), `h100-pcie5`, `h100-deepseek-v3`, `local-disk`, each with its source (how every figure was
derived or measured: docs/simulator.md); `measured:PATH`, one calibrated by `moestream bench engine
--json` or `bench fidelity --json`. Every field can be overridden (`CostModel.with_overrides`, the
CLI's `--layer-compute-ms` ...). Bandwidths are decimal (1 GB/s = 1e9 B/s). Knows no policy or trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from moestream.errors import MoestreamError

LINKS = ("host_to_device", "disk_to_host")


class CostModelError(MoestreamError):
    """An unknown preset or a cost figure that makes no sense."""


@dataclass(frozen=True)
class CostModel:
    name: str
    layer_compute_ms: float  # one MoE decoder layer, one decode token, its experts resident
    host_to_device_gbps: float
    disk_to_host_gbps: float
    host_to_device_latency_ms: float = 0.01
    disk_to_host_latency_ms: float = 0.1
    expert_compute_ms: float = 0.0  # each distinct expert of a layer beyond top_k (batches, prefill)
    token_compute_ms: float = 0.0  # each token of an iteration beyond the first
    host_holds_all: bool = True  # host DRAM holds every expert; else the device tier reads from disk
    demand_batch_ms: float = 0.0  # once per layer's demand loads read together (the engine batches its misses)
    routed_expert_ms: float = 0.0  # one routed expert's compute for one token, part of layer_compute_ms: what
    # a layer can compute while its misses load (SimConfig.expert_order); 0: the layer waits for the last
    # host compute (moestream.bench.sim.host_compute): expert-MLP weight streaming (GB/s) and arithmetic (TFLOP/s)
    # of the host's threads and of the device; 0: unknown (--host-compute is refused)
    host_expert_gbps: float = 0.0
    host_tflops: float = 0.0
    device_expert_gbps: float = 0.0
    device_tflops: float = 0.0
    weight_bytes: float = 2.0  # bytes per expert weight (bf16; FP8: 1): an expert's params from its bytes
    source: str = ""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float | int) and not isinstance(value, bool) and value < 0:
                raise CostModelError(f"cost model {self.name!r}: {f.name} must be >= 0, got {value}")
        for link in LINKS:
            if getattr(self, f"{link}_gbps") <= 0:
                raise CostModelError(f"cost model {self.name!r}: {link}_gbps must be > 0")

    @property
    def device_link(self) -> str:
        """The link that fills the device tier: from host DRAM, or from disk when no host tier."""
        return "host_to_device" if self.host_holds_all else "disk_to_host"

    def transfer_ms(self, nbytes: int, link: str | None = None) -> float:
        """Time to move nbytes over link (default: the link that fills the device tier)."""
        link = link or self.device_link
        if link not in LINKS:
            raise CostModelError(f"unknown link {link!r}; known: {', '.join(LINKS)}")
        gbps = getattr(self, f"{link}_gbps")
        return getattr(self, f"{link}_latency_ms") + nbytes / (gbps * 1e6)

    def compute_ms(self, num_tokens: int, num_experts: int, top_k: int) -> float:
        """One MoE layer's compute for an iteration of num_tokens touching num_experts experts."""
        extra_experts = max(0, num_experts - top_k)
        return self.layer_compute_ms + self.expert_compute_ms * extra_experts + self.token_compute_ms * (num_tokens - 1)

    @property
    def computes_on_host(self) -> bool:
        """Whether it has the figures host compute needs (and a host that holds experts)."""
        figures = (self.host_expert_gbps, self.host_tflops, self.device_expert_gbps, self.device_tflops)
        return self.host_holds_all and min(figures) > 0 and self.weight_bytes > 0

    def with_overrides(self, **values) -> "CostModel":
        """A copy with the given fields replaced; None values are ignored."""
        given = {k: v for k, v in values.items() if v is not None}
        return replace(self, **given) if given else self


# Host compute figures (SimConfig.host_compute). A host's expert-MLP streaming is what a matrix-vector product
# over one expert's weights reaches with all its threads, well below STREAM (17-44 MB per expert, bf16 widened to
# fp32); its arithmetic, the share of its bf16 peak torch/oneDNN reach at 10-200 rows. A device's figures are the
# effective memory bandwidth and tensor rate its preset's compute figures were derived from (docs/simulator.md).
# pcie4-consumer: a 16-core Zen 4 workstation (2 x DDR5-5600: 90 GB/s peak, ~60 GB/s STREAM): 40 GB/s, and
#   1 TFLOP/s bf16 (AVX-512 BF16: 16 cores x 4.5 GHz x 64 flops = 4.6 peak); RTX 4090: 800 of its 1008 GB/s,
#   80 of its 165 TFLOP/s bf16.
# h100-*: a one-socket 56-core Sapphire Rapids server (8 x DDR5-4800: 307 GB/s peak, ~200 GB/s STREAM): 100 GB/s,
#   and 4 TFLOP/s bf16 with AMX (a small share of its peak at a few rows per expert); H100 PCIe: 1.6 TB/s and
#   380 TFLOP/s; H100 SXM: 2.7 TB/s and 600 TFLOP/s FP8.
CONSUMER_HOST = {"host_expert_gbps": 40.0, "host_tflops": 1.0}
SERVER_HOST = {"host_expert_gbps": 100.0, "host_tflops": 4.0}

PRESETS: dict[str, CostModel] = {
    model.name: model
    for model in (
        CostModel(
            name="pcie4-consumer",
            layer_compute_ms=0.25,
            expert_compute_ms=0.022,
            token_compute_ms=0.002,
            host_to_device_gbps=25.0,
            disk_to_host_gbps=3.0,
            **CONSUMER_HOST, device_expert_gbps=800.0, device_tflops=80.0,
            source="RTX-4090-class GPU, PCIe 4.0 x16 (32 GB/s nominal, 25 GB/s effective); compute derived",
        ),
        CostModel(
            name="h100-pcie5",
            layer_compute_ms=0.13,
            expert_compute_ms=0.011,
            token_compute_ms=0.0005,
            host_to_device_gbps=50.0,
            disk_to_host_gbps=6.0,
            **SERVER_HOST, device_expert_gbps=1600.0, device_tflops=380.0,
            source="H100 PCIe on PCIe 5.0 x16 (64 GB/s nominal, 50 GB/s effective); compute derived",
        ),
        CostModel(
            name="h100-deepseek-v3",
            layer_compute_ms=0.26,
            expert_compute_ms=0.016,
            token_compute_ms=0.002,
            routed_expert_ms=0.016,
            host_to_device_gbps=50.0,
            disk_to_host_gbps=6.0,
            **SERVER_HOST, device_expert_gbps=2700.0, device_tflops=600.0, weight_bytes=1.0,
            source="H100 SXM on PCIe 5.0 x16, NVMe; DeepSeek-V3-shaped layer in FP8, compute derived",
        ),
        CostModel(
            name="local-disk",
            layer_compute_ms=47.7,
            expert_compute_ms=5.0,
            token_compute_ms=2.0,
            host_to_device_gbps=10.0,
            disk_to_host_gbps=1.0,
            disk_to_host_latency_ms=0.066,
            host_holds_all=False,
            source="measured 2026-11-20 on the dev VM: dd iflag=direct 1 GiB (1.0 GB/s), torch bf16 CPU layer",
        ),
    )
}

DEFAULT_COST_MODEL = "pcie4-consumer"
MEASURED_PREFIX = "measured:"


def get_cost_model(name: str) -> CostModel:
    if name.startswith(MEASURED_PREFIX):
        return load_measured(Path(name[len(MEASURED_PREFIX):]))
    if name not in PRESETS:
        raise CostModelError(f"unknown cost model {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def measured_cost_model(num_layers: int, decode_ms_per_token: float, expert_bytes: int, expert_read_ms: float,
                        source: str, experts_per_batch: float = 1.0, disk_gbps: float = 0.0,
                        read_line_ms: tuple[float, float] | None = None, routed_expert_ms: float = 0.0) -> CostModel:
    """The cost model of a machine whose decode step computes for decode_ms_per_token and whose disk
    reads one expert (of expert_bytes) in expert_read_ms on average.

    A read batch costs a fixed part plus each expert's time: read_line_ms (fixed, per expert), a line
    fitted to the run's batches, when given; else each expert's bytes at the disk's bandwidth
    (disk_gbps), the fixed part being what the mean read time leaves times the mean batch size; else
    the mean read time per expert. routed_expert_ms: one routed expert's compute for one token."""
    if num_layers < 1 or decode_ms_per_token <= 0 or expert_read_ms <= 0:
        raise CostModelError("a measured cost model needs a positive decode time and expert read time")
    if read_line_ms is not None:
        batch_ms, per_expert_ms = read_line_ms
    else:
        per_expert_ms = expert_bytes / (disk_gbps * 1e6) if disk_gbps > 0 else expert_read_ms
        if per_expert_ms >= expert_read_ms or experts_per_batch < 1:
            per_expert_ms = expert_read_ms
        batch_ms = (expert_read_ms - per_expert_ms) * experts_per_batch
    return CostModel(name="measured", layer_compute_ms=decode_ms_per_token / num_layers,
                     host_to_device_gbps=PRESETS["local-disk"].host_to_device_gbps,
                     disk_to_host_gbps=expert_bytes / (per_expert_ms * 1e6), disk_to_host_latency_ms=0.0,
                     demand_batch_ms=batch_ms, routed_expert_ms=routed_expert_ms, host_holds_all=False,
                     source=source)


def load_measured(path: Path) -> CostModel:
    """A measured cost model from a JSON file: CostModel fields, at top level or under "cost_model"."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CostModelError(f"cannot read a measured cost model from {path}: {error}") from None
    data = data.get("cost_model", data) if isinstance(data, dict) else None
    names = {f.name for f in fields(CostModel)}
    if not isinstance(data, dict) or not {"layer_compute_ms", "disk_to_host_gbps"} <= set(data):
        raise CostModelError(f"{path} holds no measured cost model (layer_compute_ms, disk_to_host_gbps, ...)")
    try:
        return CostModel(**({k: v for k, v in data.items() if k in names} | {"name": f"{MEASURED_PREFIX}{path}"}))
    except TypeError as error:
        raise CostModelError(f"{path}: {error}") from None
