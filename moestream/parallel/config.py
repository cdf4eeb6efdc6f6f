"""The settings of expert parallelism, declared once (the CLI's flags are generated from them). They
take effect under torchrun (moestream.parallel.launch); one process ignores them. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import MoestreamError
from moestream.settings import check, setting


@dataclass(frozen=True)
class ParallelConfig:
    expert_parallel_placement: str = setting(
        "round-robin", "under torchrun, which rank owns each expert: round-robin, or balanced (even expected "
        "load per rank from a routing trace's activation counts, co-activated experts spread)", metavar="NAME")
    expert_parallel_trace: str | None = setting(
        None, "routing trace whose activation counts the balanced placement evens (default: --replay-routing's)",
        metavar="TRACE")
    expert_parallel_plan: str | None = setting(None, "under torchrun, save the placement to this JSON file",
                                               metavar="PATH")

    def __post_init__(self):
        from moestream.parallel.placement import PLACEMENTS

        check(self)
        if self.expert_parallel_placement not in PLACEMENTS:
            raise MoestreamError(f"--expert-parallel-placement: unknown placement {self.expert_parallel_placement!r}; "
                                 f"choose from {', '.join(PLACEMENTS.names())}")
