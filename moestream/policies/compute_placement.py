"""Where a device-tier miss computes: on the device once its bytes have crossed the link, or on the host
(from its host slot, or a host buffer its disk read lands in), its rows sent down and its result back. A
rule (`COMPUTE_RULES`) decides per layer step from a cost model (`ComputeCosts`); the engine and the
simulator carry the choice out and know no rule.

- `off`: every miss computes on the device;
- `share:F`: a share F of the misses computes on the host, fewest rows first (llama.cpp's
  `--moe-cache-cpu-share`);
- `default`: misses go to the host, cheapest first, while that lowers the layer's modelled finish time
  (the device computes its hits while the link brings its misses, then those; the host beside it).

The candidates (`layer_candidates`) are the misses in the host tier, then up to DISK_CANDIDATES only on
disk (read into a host compute buffer, never copied up: the rules weigh the copy it saves). Knows no store,
engine, clock or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from moestream.errors import MoestreamError
from moestream.registry import Registry
from moestream.topology import ExpertKey


@dataclass(frozen=True)
class ComputeCosts:
    """What moving and computing an expert costs, in ms, from a run's measured or preset figures."""

    link_bytes_per_ms: float  # host -> device (and back) bandwidth
    host_bytes_per_ms: float  # the host's expert-MLP weight streaming with its threads
    device_bytes_per_ms: float  # the device's
    host_flops_per_ms: float  # the host's expert-MLP arithmetic rate with its threads
    device_flops_per_ms: float
    expert_bytes: int
    expert_params: int  # one expert's weights (2 flops per weight and row)
    row_bytes: int  # one row's hidden state

    def copy_ms(self) -> float:
        """One expert's bytes over the link."""
        return self.expert_bytes / self.link_bytes_per_ms

    def host_ms(self, rows: int) -> float:
        """One expert's MLP on the host, plus its rows over the link both ways: streaming its weights, then
        each row's arithmetic (a sum, not the roofline's max: docs/measurements/host-compute.md)."""
        work = self.expert_bytes / self.host_bytes_per_ms + 2.0 * rows * self.expert_params / self.host_flops_per_ms
        return work + 2.0 * rows * self.row_bytes / self.link_bytes_per_ms

    def device_ms(self, rows: int) -> float:
        return self.expert_bytes / self.device_bytes_per_ms + 2.0 * rows * self.expert_params / self.device_flops_per_ms


DISK_CANDIDATES = 8  # misses only on disk offered to the host per layer step (each needs a host buffer)


@dataclass(frozen=True)
class Candidate:
    key: ExpertKey
    rows: int  # its (token, k) rows in this step
    from_disk: bool = False  # only on disk: read into a host buffer if placed on the host


def layer_candidates(misses: Sequence[ExpertKey], rows: Callable[[ExpertKey], int],
                     in_host: Callable[[ExpertKey], bool]) -> list[Candidate]:
    """A layer step's candidates, in order: those in the host tier and the first DISK_CANDIDATES others."""
    on_disk = [key for key in misses if not in_host(key)][:DISK_CANDIDATES]
    return [Candidate(key, rows(key), key in on_disk) for key in misses if in_host(key) or key in on_disk]


class ComputeRule:
    """Names the misses that compute on the host this layer step."""

    registry_name: ClassVar[str]

    def place(self, candidates: Sequence[Candidate], hit_rows: Sequence[int], other_misses: int,
              costs: ComputeCosts) -> frozenset[ExpertKey]:
        """The candidates to compute on the host (hit_rows: each device hit's; other_misses: to cross anyway)."""
        raise NotImplementedError


COMPUTE_RULES: Registry[ComputeRule] = Registry("host compute rule")


@COMPUTE_RULES.register("off")
class Off(ComputeRule):
    def place(self, candidates, hit_rows, other_misses, costs) -> frozenset[ExpertKey]:
        return frozenset()


@COMPUTE_RULES.register("share")
class Share(ComputeRule):
    """share:F, F in [0, 1]: ceil(F x candidates) of them, the fewest rows first (then by key)."""

    def __init__(self, share: float = 0.5):
        if not 0.0 <= share <= 1.0:
            raise MoestreamError(f"--host-compute share:{share}: the share must be between 0 and 1")
        self.share = share

    def place(self, candidates, hit_rows, other_misses, costs) -> frozenset[ExpertKey]:
        count = math.ceil(self.share * len(candidates))
        chosen = sorted(candidates, key=lambda c: (c.rows, c.key))[:count]
        return frozenset(c.key for c in chosen)


@COMPUTE_RULES.register("default")
class FinishTime(ComputeRule):
    """The cheapest-first placement that lowers the layer's modelled finish time (module docstring)."""

    def place(self, candidates, hit_rows, other_misses, costs) -> frozenset[ExpertKey]:
        device = sorted(candidates, key=lambda c: (costs.host_ms(c.rows) - costs.copy_ms(), c.key))
        host: list[Candidate] = []
        best = finish_ms(device, host, hit_rows, other_misses, costs)
        while device:
            trial = finish_ms(device[1:], host + device[:1], hit_rows, other_misses, costs)
            if trial >= best:
                break
            best, host, device = trial, host + device[:1], device[1:]
        return frozenset(c.key for c in host)


def finish_ms(device: Sequence[Candidate], host: Sequence[Candidate], hit_rows: Sequence[int], other_misses: int,
              costs: ComputeCosts) -> float:
    """The layer's modelled finish: the device computes its hits, then each miss once its copy has landed
    (behind the other misses' copies; what every placement shares is left out); the host computes its own."""
    clock = sum(costs.device_ms(rows) for rows in hit_rows)
    landed = other_misses * costs.copy_ms()
    for candidate in device:
        landed += costs.copy_ms()
        clock = max(clock, landed) + costs.device_ms(candidate.rows)
    clock = max(clock, landed)
    return max(clock, sum(costs.host_ms(c.rows) for c in host))


def compute_rule(text: str) -> ComputeRule:
    """A rule from its flag text: `off`, `default` or `share:F`."""
    name, _, argument = text.partition(":")
    if name not in COMPUTE_RULES:
        raise MoestreamError(f"--host-compute {text!r}: unknown rule; rules: off, share:F, default")
    if name == "share":
        try:
            return Share(float(argument))
        except ValueError:
            raise MoestreamError(f"--host-compute {text!r}: write share:F with F between 0 and 1") from None
    if argument:
        raise MoestreamError(f"--host-compute {text!r}: {name} takes no argument")
    return COMPUTE_RULES.create(name)
