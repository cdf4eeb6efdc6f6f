"""The stream protocol: the engine's mechanism in virtual time, driven by a replayed trace.

The policy is called through a `PolicyDriver`, whose `LayerMechanism` this is. The experts move through
the store's own mechanism, a `LinkChain` (its transfer core, host tier, queues, `defer`, promotion and
rounds), run by a `VirtualExecutor` (`moestream.bench.sim.clock`) whose rounds last what the cost model says:
per MoE layer the chain fetches the layer's experts and queues its misses as demand, the planner's
requests after the layer are admitted and queued by priority, and the layer computes once its experts
are ready (the wait is the stall) while the links keep moving. This module only times compute and the
rounds (a cost model) and counts. Its documented choices (expert order, chunks): docs/simulator.md.
Knows the policy contract, not any policy by name.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Callable, Iterable

from moestream.bench.sim.clock import Alone, VirtualExecutor, VirtualSegment, VirtualSlots
from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.host_compute import HostCompute
from moestream.bench.sim.metrics import LayerCounts, StreamCounters
from moestream.bench.sim.protocols import PROTOCOLS, REPLAYS, Protocol
from moestream.cache import ExpertCache
from moestream.contracts import Policy, Prediction
from moestream.errors import BudgetError
from moestream.link_model import ModelledLink
from moestream.policies.driver import PolicyDriver
from moestream.store.chain import LinkChain, Tier
from moestream.store.transfer import DISK, H2D, Held, pieces
from moestream.topology import ExpertKey
from moestream.trace.replay import Iteration
from moestream.trace.schema import Trace
from moestream.tracer import Tracer


class StreamSimulator:
    def __init__(self, policy: Policy, config: SimConfig, compute_ms: Callable[[int, int], float] | None = None):
        """compute_ms(num_tokens, num_experts): a layer's compute, if not the cost model's (bench.sim.ranks)."""
        topo, cost = policy.topology, config.cost
        self.policy, self.config, self.cost, self.topology = policy, config, cost, topo
        device = ExpertCache(config.device_slots_of(topo), policy.make_eviction("device"))
        host = ExpertCache(config.host_slots_of(topo), policy.make_eviction("host")) if config.has_host_tier else None
        # the cost model's link of each lane: disk -> host -> device, or one link that fills the device tier
        self.lanes = {DISK: "disk_to_host", H2D: "host_to_device"} if host is not None else {DISK: cost.device_link}
        self.device_link = self.lanes[H2D if host is not None else DISK]
        self._round_ms_of = {lane: cost.transfer_ms(topo.expert_bytes, link) for lane, link in self.lanes.items()}
        self.executor = VirtualExecutor(config.chunks_in_flight, self._round_ms, self._on_round, config.sync)
        parts = pieces([VirtualSegment(topo.expert_bytes)], -(-topo.expert_bytes // config.num_expert_chunks))
        tiers = (Tier(device, VirtualSlots()), Tier(host, VirtualSlots()) if host is not None else None)
        self.chain = LinkChain(lambda key: parts, defaultdict(int), tiers, None, Alone(), self.executor.wait,
                               topo.expert_bytes)
        self.executor.start(Alone(), self.chain.make_links(_unmoved, _unmoved), Tracer())
        self.core, self.device, self.host = self.chain.core, device, host
        self.core.link = self._link_model(config, topo) if config.modelled_link else None
        self.driver = PolicyDriver(policy, [tier.policy for tier in (device, host) if tier is not None],
                                   horizon_layers=config.horizon_layers)
        self.keys = [[ExpertKey(layer, e) for e in range(topo.num_experts)] for layer in range(topo.num_layers)]
        self._layer_ms = compute_ms or functools.cache(lambda tokens, n: cost.compute_ms(tokens, n, topo.top_k))
        self.host_compute = HostCompute(config, topo) if config.host_compute != "off" else None
        self._layer: tuple | None = None  # routed: its start, needed, on the host, host lane ms, held, tokens
        self._planned: set[ExpertKey] = set()  # experts a plan queued that have not landed or been given up
        self._refused = self._from_host = 0  # prefetches the chain refused; misses computed from host slots
        self._landed_at: dict[ExpertKey, float] = {}  # when each expert's bytes last landed in the device tier
        links = dict.fromkeys(self.lanes.values(), 0)
        self.counters = StreamCounters(LayerCounts(topo.num_layers), bytes_by_link=links)

    @property
    def now(self) -> float:
        return self.executor.now_ms

    def _link_model(self, config: SimConfig, topo) -> ModelledLink:
        """The planner's link: the engine's own figures where given, else the cost model's device link. A
        layer's misses land together (one demand round), and it ends layer_ms after them (exact where its
        experts all missed; with routed_expert_ms, those it held compute first, so it may end sooner)."""
        if config.link_figures is not None:
            return config.link_figures.model(topo)
        layer_ms, nbytes = config.cost.layer_compute_ms, topo.expert_bytes
        return ModelledLink(nbytes / self._round_ms_of[DISK if self.host is None else H2D], layer_ms, nbytes,
                            topo.num_layers, layer_ms)

    def run(self, iterations: Iterable[Iteration]) -> StreamCounters:
        for it in iterations:
            self.driver.run_iteration(it, self)
            self.counters.num_tokens += it.ctx.num_tokens
            self.counters.num_iterations += 1
        counters, counts, stats = self.counters, self.core.counts, self.chain.stats
        counters.prefetch_hits, counters.wasted_prefetches = counts.prefetch_hits, counts.wasted
        counters.prefetches_admitted = counts.prefetched
        counters.prefetches_dropped = self._refused + stats.cancelled
        counters.sim_ms = self.now
        fills = stats.host_hits + stats.host_misses  # device fills by where they came from
        counters.host_accesses = self._from_host + fills
        counters.host_hits = self._from_host + (stats.host_hits if self.host is not None else
                                                fills * self.cost.host_holds_all)
        return counters

    def routed(self, event, num_tokens: int) -> None:
        """The layer's lookups, its late experts promoted and its misses queued (LayerMechanism)."""
        layer, keys = event.layer, self.keys[event.layer]
        ids = sorted(set(event.expert_ids.ravel().tolist()))  # the engine's order: its eviction breaks ties by it
        needed = [keys[e] for e in ids]
        if len(needed) > self.device.capacity:
            raise BudgetError(f"layer {layer} needs {len(needed)} experts at once but the device tier has "
                              f"{self.device.capacity} slots; raise the cache ratio")
        start_ms = self.now
        self._layer = start_ms, needed, *self._fetch(layer, needed, event.expert_ids), num_tokens

    def predicted(self, layer_now: int, predictions: list[Prediction]) -> None:
        """Plan the predictions; after a routed layer, compute it (LayerMechanism)."""
        self._plan(layer_now, predictions)
        if layer_now >= 0:
            self._compute_layer(*self._layer)
            self._layer = None

    def wait_until(self, until_ms: float) -> None:
        """Idle until until_ms (other ranks or the network hold the step); the links keep moving."""
        self.executor.advance(until_ms)

    def _fetch(self, layer: int, needed: list[ExpertKey], expert_ids) -> tuple[list, float, list]:
        """The chain's fetch (the rule between the lookups and the admissions, with host compute) and its
        demand loads; returns the misses the host computes, the host lane's time for them and those of them
        it holds in the host tier (the others it reads from disk)."""
        chain, counters = self.chain, self.counters
        on_host, host_ms, held = [], 0.0, []
        if self.host_compute is None:
            late, missed = chain.fetch(needed, set(needed))
        else:
            chain.defer(needed, set(needed))
            placed = self.host_compute.fetch_layer(self.core, needed, expert_ids, self._in_host, chain.unstarted)
            late, missed, on_host, host_ms = placed.late, placed.missed, placed.on_host, placed.host_ms
            from_host = [key for key in on_host if key not in placed.from_disk]
            held = chain.hold_host(from_host)  # pinned there until the layer ends
            counters.host_computed += len(on_host)
            self._from_host += len(from_host)
            chain.promote(late)
        queued = [key for key in late if chain.unstarted(key)]  # promoted before they started: demand loads
        self._planned.intersection_update(self.core.moving)  # those displaced are given up
        self._planned.difference_update(queued)
        counters.late_prefetches += len(late) - len(queued)
        counters.demand_fetches += len(missed) + len(queued)
        chain.bring(needed, missed)
        self.executor.queued(None)
        counters.layers.hits[layer] += len(needed) - len(missed) - len(on_host)
        counters.layers.accesses[layer] += len(needed)
        return on_host, host_ms, held

    def _in_host(self, key: ExpertKey) -> bool:
        """key's bytes are ready in host memory (every expert is when host DRAM holds them all)."""
        return self.chain.host_ready(key) if self.host is not None else self.cost.host_holds_all

    def _compute_layer(self, start_ms: float, needed: list[ExpertKey], on_host: list[ExpertKey], host_ms: float,
                       held: list[ExpertKey], num_tokens: int) -> None:
        """The device computes the layer (its whole compute_ms) once its experts allow; the host its own
        misses beside it from the routing on (held: those pinned in the host tier): the layer ends when both
        are done (sim.host_compute)."""
        compute_ms = self._layer_ms(num_tokens, len(needed))
        on_device = [key for key in needed if key not in on_host] if on_host else needed
        lands = self._landings(on_device, start_ms)
        stall_ms = self._stall_ms(start_ms, on_device, lands, num_tokens, compute_ms, len(needed))
        if self.config.sync:  # the rounds its calls ran (its plan's too) were the compute thread's
            stall_ms = max(stall_ms, self.now - start_ms)
        ready_ms = start_ms + max(stall_ms, host_ms - compute_ms)
        self.counters.resident_ms += compute_ms
        self.counters.stall_ms += ready_ms - start_ms
        self.executor.advance(ready_ms + compute_ms)
        self.device.unpin(on_device)
        if held:
            self.host.unpin(held)

    def _landings(self, keys: list[ExpertKey], start_ms: float) -> dict[ExpertKey, float]:
        """Runs the links until every key's bytes have landed; when each landed after start_ms (while its
        demand waited for a host slot, or later)."""
        moving, landed = self.core.moving, self._landed_at
        pending = [key for key in keys if key in moving]
        lands = {key: landed[key] for key in keys if key not in moving and landed.get(key, start_ms) > start_ms}
        while pending:
            if not self.executor.step():
                raise BudgetError(f"experts {[tuple(k) for k in pending]} can never land")
            lands.update((key, self.now) for key in pending if key not in moving)
            pending = [key for key in pending if key in moving]
        return lands

    def _stall_ms(self, start_ms: float, on_device: list[ExpertKey], lands: dict[ExpertKey, float], num_tokens: int,
                  compute_ms: float, num_needed: int) -> float:
        """How long the layer waits for expert bytes. Its routed experts on the device compute routed_expert_ms
        each (times the mean rows of the layer's num_needed experts, and never more than one's share of the
        layer's compute) in the config's expert_order, each once it has landed: the wait is what that compute
        does not cover. "loaded", or no routed_expert_ms: until the last one lands."""
        order, num_experts = self.config.expert_order, len(on_device)
        rows = num_tokens * self.topology.top_k / max(num_needed, 1)  # a rank of several may need none
        expert_ms = min(self.cost.routed_expert_ms * rows, compute_ms / max(num_needed, 1))
        if expert_ms == 0.0 or order == "loaded" or not lands:
            return max([start_ms, *lands.values()]) - start_ms
        if order == "ready":  # resident first, then as they land
            starts = [start_ms] * (num_experts - len(lands)) + sorted(lands.values())
        else:  # "given": in the layer's order, waiting for each
            starts = [lands.get(key, start_ms) for key in on_device]
        waited, done = 0.0, start_ms
        for landed in starts:
            if landed > done:
                waited += landed - done
                done = landed
            done += expert_ms
        return waited

    def _plan(self, layer_now: int, predictions: list[Prediction]) -> None:
        """The planner's requests for what is predicted now, admitted by the core and queued by priority."""
        if layer_now < 0 and not predictions:
            return  # nothing new before the first layer: the last layer's plan stands
        if not predictions:
            self.core.end_plan()
            return
        view = self.core.plan_view(layer_now, self.topology.num_layers)
        requests = self.driver.plan(predictions, view)
        before = self.core.counts.prefetched
        brought = self.chain.prefetch({r.key: r.priority for r in requests})
        self._refused += self.core.counts.prefetched - before - len(brought)
        self._planned.intersection_update(self.core.moving)
        self._planned.update(brought)
        self.executor.queued(None)

    def _round_ms(self, lane: str, held: Held) -> float:
        """A round's time: each transfer's share of its link's time for a whole expert, by its chunks moved,
        and a demand round's batch cost once (the engine reads a layer's misses together)."""
        whole = self._round_ms_of[lane]
        ms = sum(whole * count / len(transfer.parts) for transfer, count in held)
        demand = lane == DISK and any(transfer.demand for transfer, _ in held)
        return ms + self.cost.demand_batch_ms * demand

    def _on_round(self, lane: str, held: Held, finished: bool) -> None:
        """Counts a round: as it starts, its bytes and the prefetches it starts; as it finishes, when what it
        lands landed, and the prefetches among them."""
        counters, last = self.counters, lane == (H2D if self.host is not None else DISK)
        if not finished:
            name = self.lanes[lane]
            moved = sum(seg.nbytes for t, count in held for seg, _ in t.parts[t.next_chunk:][:count])
            counters.bytes_by_link[name] += moved
        for transfer, count in held:
            lands = finished and last and not transfer.dropped and transfer.next_chunk + count >= len(transfer.parts)
            if lands:
                self._landed_at[transfer.key] = self.now
            if transfer.key not in self._planned or transfer.dropped:
                continue
            if not finished:
                counters.prefetches_started += not (transfer.next_chunk or transfer.staged or transfer.demand)
            elif lands:
                counters.prefetches_landed += 1
                self._planned.discard(transfer.key)


def _unmoved(held: Held) -> dict:
    """A link's copy function in virtual time: nothing moves, nothing fails."""
    return {}


@PROTOCOLS.register("stream")
class StreamProtocol(Protocol):
    """The discrete-event simulation of a serving stream under a cost model."""

    def run(self, policy: Policy, trace: Trace, config: SimConfig) -> dict:
        simulator = StreamSimulator(policy, config)
        counters = simulator.run(REPLAYS[config.mode](trace, config))
        return counters.summary(simulator.device_link)
