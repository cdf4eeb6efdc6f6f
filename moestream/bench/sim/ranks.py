"""Expert parallelism in virtual time: R ranks, each a StreamSimulator over the experts a placement
gives it, stepping through every MoE layer together.

Each rank has its own tiers, sized by the per-rank budget, and its own copy of the policy, which
observes the whole routing and prefetches only what its rank owns; rank 0 holds the tokens, and a
layer's dispatch and combine cross each rank pair's link (the model of one step: docs/simulator.md).
With one rank and no network this is the single-process simulator, figure for figure. Knows the
policy contract and a placement, not any policy or placement by name.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace
from typing import Iterable

import numpy as np

from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.engine import StreamSimulator
from moestream.bench.sim.network import NETWORKS, NO_NETWORK, NetworkLink
from moestream.bench.sim.protocols import REPLAYS, SimulationError, check_compatible
from moestream.contracts import Policy
from moestream.errors import MoestreamError
from moestream.events import RoutingEvent
from moestream.parallel.config import ParallelConfig
from moestream.parallel.placement import Placement
from moestream.settings import default_of, same_as, setting
from moestream.trace.replay import Iteration
from moestream.trace.schema import Trace

HOME = 0  # the rank that holds the tokens


def parse_ranks(text: str, flag: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); a refusal names the flag."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise MoestreamError(f"{flag}: {text!r} is not a list of rank counts (1,2,4,8)") from None
    if not counts or min(counts) < 1:
        raise MoestreamError(f"{flag}: every rank count must be >= 1, got {text!r}")
    return counts


@dataclass(frozen=True)
class RanksConfig:
    """How `moestream sim` spreads experts over ranks (its flags)."""

    ranks: tuple[int, ...] | None = setting(
        None, "simulate expert parallelism on each of these numbers of ranks (one GPU each; per-rank budgets "
              "as --cache-ratio/--host-ratio of all experts) and print the scaling", parse=parse_ranks,
        metavar="N[,N...]")
    network: str = setting(NO_NETWORK, f"the link of each rank pair: {', '.join([NO_NETWORK, *NETWORKS])}")
    expert_parallel_placement: str = same_as(
        ParallelConfig, "expert_parallel_placement", help="which rank owns each expert: round-robin, or balanced "
        "(from --train's routing, else the replayed trace's); the engine's setting of the same name")
    hidden_bytes: int = same_as(SimConfig, "hidden_bytes")  # with --host-compute too: SimConfig's


@dataclass(frozen=True)
class RankSetup:
    placement: Placement
    network: NetworkLink | None = None  # None: messages cost nothing
    hidden_bytes: int = default_of(SimConfig, "hidden_bytes")  # one token's hidden state on the wire (2 x hidden size)

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    def message_ms(self, rank: int, tokens: int) -> float:
        """One message of tokens' hidden states between HOME and rank (none to itself or of nothing)."""
        if self.network is None or rank == HOME or tokens == 0:
            return 0.0
        return self.network.message_ms(tokens * self.hidden_bytes)


class Rank:
    """One rank: its StreamSimulator, fed the driver's steps for the experts it owns."""

    def __init__(self, index: int, policy: Policy, config: SimConfig, owned: np.ndarray):
        topo, owns = policy.topology, int(owned.sum())
        self.index, self.owned = index, owned  # owned: [L, E] bool
        slots = {"device_slots": min(owns, config.device_slots_of(topo)),
                 "host_slots": min(owns, config.host_slots_of(topo)) if config.has_host_tier else 0}
        self.sim = StreamSimulator(policy, replace(config, **slots), self._compute_ms)
        self.driver, self.cost, self.top_k = self.sim.driver, config.cost, topo.top_k
        self.rows = self.tokens = self.layer_experts = 0  # the routed layer's, on this rank
        self.compute_ms = 0.0  # the routed layer's compute
        self.network_bytes = 0

    def begin(self, it: Iteration) -> None:
        self.driver.begin_iteration(it.ctx)
        self._predicted(-1)

    def share(self, event: RoutingEvent) -> np.ndarray:
        """The routed rows this rank computes, [T, K] bool; counts its rows and tokens."""
        mine = self.owned[event.layer][event.expert_ids]  # [T, K]
        self.rows, self.tokens = int(mine.sum()), int(mine.any(axis=1).sum())
        self.layer_experts = len(np.unique(event.expert_ids))
        return mine

    def route(self, event: RoutingEvent, num_tokens: int, mine: np.ndarray, arrives_ms: float) -> None:
        """The whole routing to the policy; the rank's own experts to its mechanism once dispatched."""
        self.driver.observe(event)
        self.sim.wait_until(arrives_ms)
        self.sim.routed(replace(event, expert_ids=event.expert_ids[mine]), num_tokens)

    def compute(self, layer: int) -> None:
        self._predicted(layer)

    def end(self, it: Iteration) -> None:
        for seq in it.finished:
            self.driver.end_sequence(seq)
        self.sim.counters.num_tokens += it.ctx.num_tokens
        self.sim.counters.num_iterations += 1

    def summary(self) -> dict:
        counters = self.sim.run(())  # no more iterations: the totals filled in
        figures = counters.summary(self.sim.device_link)
        return figures | {"rank": self.index, "experts_owned": int(self.owned.sum()),
                          "device_slots": self.sim.device.capacity,
                          "network_bytes_per_token": self.network_bytes / max(counters.num_tokens, 1)}

    def _predicted(self, layer: int) -> None:
        """The policy's predictions, kept for the experts this rank owns."""
        predictions = self.driver.predict(layer)
        self.sim.predicted(layer, [p for p in predictions if self.owned[p.layer, p.expert]])

    def _compute_ms(self, num_tokens: int, num_experts: int) -> float:
        cost, k = self.cost, self.top_k
        if self.index != HOME:
            self.compute_ms = cost.routed_expert_ms * self.rows
        else:
            whole = cost.compute_ms(num_tokens, self.layer_experts, k)
            others = cost.routed_expert_ms * (num_tokens * k - self.rows)
            self.compute_ms = max(whole - others, cost.layer_compute_ms - k * cost.routed_expert_ms)
        return self.compute_ms


class RankedSimulation:
    """R ranks stepping through each MoE layer together, with the network between them."""

    def __init__(self, policy: Policy, config: SimConfig, setup: RankSetup):
        owners = np.asarray(setup.placement.owners)  # [L, E]
        self.setup = setup
        self.ranks = [Rank(r, copy.deepcopy(policy), config, owners == r) for r in range(setup.world_size)]
        self.now = self.resident_ms = self.network_ms = 0.0
        self.num_tokens = self.num_iterations = 0

    def run(self, iterations: Iterable[Iteration]) -> dict:
        for it in iterations:
            self._iteration(it)
        return self.summary()

    def _iteration(self, it: Iteration) -> None:
        for rank in self.ranks:
            rank.begin(it)
        for event in it.events:
            self._layer(event, it.ctx.num_tokens)
        for rank in self.ranks:
            rank.end(it)
        self.num_tokens += it.ctx.num_tokens
        self.num_iterations += 1

    def _layer(self, event: RoutingEvent, num_tokens: int) -> None:
        """Dispatch, each rank's experts, combine; every rank waits for the last combine."""
        start, setup = self.ranks[HOME].sim.now, self.setup
        messages = []
        for rank in self.ranks:
            mine = rank.share(event)
            message_ms = setup.message_ms(rank.index, rank.tokens)
            if message_ms:
                rank.network_bytes += 2 * rank.tokens * setup.hidden_bytes
            rank.route(event, num_tokens, mine, start + message_ms)
            messages.append(message_ms)
        for rank in self.ranks:
            rank.compute(event.layer)
        end = max(rank.sim.now + message for rank, message in zip(self.ranks, messages))
        self.resident_ms += max(rank.compute_ms + 2 * message for rank, message in zip(self.ranks, messages))
        self.network_ms += 2 * max(messages)
        for rank in self.ranks:
            rank.sim.wait_until(end)
        self.now = end

    def summary(self) -> dict:
        ranks = [rank.summary() for rank in self.ranks]
        tokens, iterations = max(self.num_tokens, 1), max(self.num_iterations, 1)
        accesses = sum(r["accesses"] for r in ranks)
        return {
            "world_size": self.setup.world_size,
            "placement": self.setup.placement.name,
            "network": None if self.setup.network is None else asdict(self.setup.network),
            "tpot_ms": self.now / iterations,
            "resident_tpot_ms": self.resident_ms / iterations,
            "stall_ms_per_token": max(r["stall_ms_per_token"] for r in ranks),  # the most stalled rank's
            "critical_stall_ms_per_token": (self.now - self.resident_ms) / tokens,  # the step's wait for bytes
            "network_ms_per_token": self.network_ms / tokens,
            "hit_rate": sum(r["hits"] for r in ranks) / accesses if accesses else 0.0,
            "bytes_per_token": sum(r["bytes_per_token"] for r in ranks),
            "num_tokens": self.num_tokens,
            "ranks": ranks,
        }


def simulate_ranks(policy: Policy, trace: Trace, config: SimConfig, setup: RankSetup) -> dict:
    """Run an already fitted policy over trace on setup's ranks (each with its own copy); the figures."""
    check_compatible(policy, trace)
    if not setup.placement.fits(trace.topology):
        raise SimulationError(f"the placement does not fit the trace ({trace.topology.routing_shape()})")
    policy.prepare(trace)
    return RankedSimulation(policy, config, setup).run(REPLAYS[config.mode](trace, config))
