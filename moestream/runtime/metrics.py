"""What one generation run measured: latency per phase and the expert store's traffic; a run's clock."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GenerationMetrics:
    ttft_ms: float  # start of the run to the first generated token (prefill)
    tpot_ms: float  # mean time of one decode step after the first token (0 when there was none)
    expert_hits: int  # experts found in the device tier when a layer needed them
    expert_misses: int  # experts fetched on demand
    bytes_read: dict[str, int] = field(default_factory=dict)  # {"disk": .., "host": ..}
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    stall_ms: float = 0.0  # whole run: time the compute thread waited for expert bytes
    transfer_ms: float = 0.0  # whole run: time the disk link was busy
    host_computed: int = 0  # device-tier misses computed on the host, from their host slots (--host-compute)

    def to_dict(self) -> dict:
        return asdict(self)


class StepClock:
    """Wall-clock marks of a run: its start and the end of every step (prefill first)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.marks: list[float] = []

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    @property
    def ttft_ms(self) -> float:
        return (self.marks[0] - self.started) * 1e3 if self.marks else 0.0

    @property
    def tpot_ms(self) -> float:
        if len(self.marks) < 2:
            return 0.0
        return (self.marks[-1] - self.marks[0]) * 1e3 / (len(self.marks) - 1)
