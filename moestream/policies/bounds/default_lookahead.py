"""`default-lookahead-4`: an offline bound, not a policy to serve with. The default's design, whose
eviction also sees the next 4 tokens' routing exactly (as Belady does), to measure how much
foresight the gap to the oracle takes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moestream.contracts import POLICIES, EvictionPolicy, Observer
from moestream.policies.bounds.offline import FutureIndex, FutureTracker, LookaheadEviction
from moestream.policies.default import Default
from moestream.topology import Topology

if TYPE_CHECKING:
    from moestream.trace.schema import Trace


@POLICIES.register("default-lookahead-4")
class DefaultLookahead4(Default):
    """Offline bound: `default` whose eviction also knows the next 4 tokens' routing exactly.

    Experts needed within the window are kept as Belady keeps them; among the rest, the default's
    eviction decides. It measures how much of the gap to the oracle a perfect short-range view of
    the future would close. Shares the default's trained predictor (same kind).
    """

    offline = True
    num_tokens = 4

    def __init__(self, topology: Topology, *args, **kwargs):
        super().__init__(topology, *args, **kwargs)
        self.future = FutureIndex(topology)
        self.tracker = FutureTracker(topology, self.future)

    def observers(self) -> list[Observer]:
        return [self.tracker, *super().observers()]

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return LookaheadEviction(self.future, self.num_tokens, super().make_eviction(tier))

    def prepare(self, trace: "Trace") -> None:
        super().prepare(trace)
        self.future.reset(trace)
