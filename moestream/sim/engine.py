"""The stream protocol: the engine's mechanism in virtual time, driven by a replayed trace.

The policy is called through a `PolicyDriver`, whose `LayerMechanism` this is: per MoE layer the
transfer core looks the layer's experts up and admits the misses (loaded on demand ahead of every
prefetch), the planner's requests after the layer are admitted by the core and queued by priority,
and the layer computes once its experts are ready (the wait is the stall) while the links keep
moving. Residency is the core's alone; this module only times the transfers (a cost model). Its
documented choices (links, host tier, demand batches, expert order): docs/simulator.md. Knows the
policy contract, not any policy by name.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from moestream.cache import CacheFullError, ExpertCache
from moestream.contracts import Policy, Prediction
from moestream.errors import BudgetError
from moestream.link_model import ModelledLink
from moestream.policies.driver import PolicyDriver
from moestream.sim.config import SimConfig
from moestream.sim.host_compute import HostCompute
from moestream.sim.metrics import LayerCounts, StreamCounters
from moestream.sim.protocols import PROTOCOLS, REPLAYS, Protocol
from moestream.sim.transfers import DROPPED, LOWER, MOVING, QUEUED, WAITING, Link, Transfer
from moestream.topology import ExpertKey
from moestream.trace.replay import Iteration
from moestream.trace.schema import Trace
from moestream.transfer_core import TransferCore


class StreamSimulator:
    def __init__(self, policy: Policy, config: SimConfig, compute_ms: Callable[[int, int], float] | None = None):
        """compute_ms(num_tokens, num_experts): a layer's compute, if not the cost model's (moestream.sim.ranks)."""
        topo, cost = policy.topology, config.cost
        self.policy, self.config, self.cost, self.topology = policy, config, cost, topo
        nbytes = topo.expert_bytes
        self.device = ExpertCache(config.device_slots_of(topo), policy.make_eviction("device"))
        self.device_link = Link(cost.device_link, cost.transfer_ms(nbytes, cost.device_link), nbytes)
        self.host: ExpertCache | None = None
        self.lower_link: Link | None = None
        if config.has_host_tier:
            self.host = ExpertCache(config.host_slots_of(topo), policy.make_eviction("host"))
            self.lower_link = Link("disk_to_host", cost.transfer_ms(nbytes, "disk_to_host"), nbytes)
        self.links = [self.device_link] + ([self.lower_link] if self.lower_link else [])
        tiers = [self.device] + ([self.host] if self.host else [])
        self.driver = PolicyDriver(policy, [tier.policy for tier in tiers], horizon_layers=config.horizon_layers)
        self.keys = [[ExpertKey(layer, e) for e in range(topo.num_experts)] for layer in range(topo.num_layers)]
        self.core: TransferCore[Transfer] = TransferCore(  # the tier's residency
            self.device, self._displaced, self._link_model(config, topo) if config.modelled_link else None)
        self.host_loading: set[ExpertKey] = set()  # moving from disk into the host tier
        self.now = 0.0
        self._layer_ms = compute_ms or functools.cache(lambda tokens, experts: cost.compute_ms(tokens, experts, topo.top_k))
        self.host_compute = HostCompute(config, topo) if config.host_compute != "off" else None
        self._layer: tuple | None = None  # routed: needed, when each lands, tokens, on the host, host lane ms
        self.counters = StreamCounters(LayerCounts(topo.num_layers))

    def _link_model(self, config: SimConfig, topo) -> ModelledLink:
        """The planner's link: the engine's own figures where given, else the cost model's device link."""
        if config.link_figures is not None:
            return config.link_figures.model(topo)
        cost, nbytes = config.cost, topo.expert_bytes
        layer_ms = cost.layer_compute_ms
        # a layer waits what computing its experts as they land leaves, then computes its whole layer_ms
        # (_stall_ms, _compute_layer): it ends layer_ms - (top_k - 1) x one expert's compute after its last landing
        expert_ms = min(cost.routed_expert_ms, layer_ms / topo.top_k)
        tail_ms = layer_ms if config.expert_order == "loaded" else layer_ms - (topo.top_k - 1) * expert_ms
        return ModelledLink(nbytes / self.device_link.transfer_ms, layer_ms, nbytes, topo.num_layers, tail_ms)

    def run(self, iterations: Iterable[Iteration]) -> StreamCounters:
        for it in iterations:
            self.driver.run_iteration(it, self)
            self.counters.num_tokens += it.ctx.num_tokens
            self.counters.num_iterations += 1
        counters, counts = self.counters, self.core.counts
        counters.prefetch_hits, counters.wasted_prefetches = counts.prefetch_hits, counts.wasted
        counters.prefetches_admitted = counts.prefetched
        counters.sim_ms = self.now
        counters.bytes_by_link = {link.name: link.bytes_moved for link in self.links}
        return counters

    def routed(self, event, num_tokens: int) -> None:
        """Pin the layer's experts, count hits and start demand loads (LayerMechanism)."""
        layer, keys = event.layer, self.keys[event.layer]
        ids = sorted(set(event.expert_ids.ravel().tolist()))  # the engine's order: its eviction breaks ties by it
        needed = [keys[e] for e in ids]
        if len(needed) > self.device.capacity:
            raise BudgetError(f"layer {layer} needs {len(needed)} experts at once but the device tier has "
                              f"{self.device.capacity} slots; raise the cache ratio")
        self._layer = needed, *self._gather(layer, needed, event.expert_ids), num_tokens

    def predicted(self, layer_now: int, predictions: list[Prediction]) -> None:
        """Plan the predictions; after a routed layer, compute it (LayerMechanism)."""
        self._plan(layer_now, predictions)
        if layer_now >= 0:
            self._compute_layer(*self._layer)
            self._layer = None

    def _compute_layer(self, needed: list[ExpertKey], lands: dict[ExpertKey, float], on_host: list[ExpertKey],
                       host_ms: float, held: list[ExpertKey], num_tokens: int) -> None:
        """The device computes the layer (its whole compute_ms) once its experts allow; the host its own
        misses beside it from the routing on (held: those pinned in the host tier): the layer ends when both
        are done (sim.host_compute)."""
        compute_ms = self._layer_ms(num_tokens, len(needed))
        stall_ms = self._stall_ms(needed, lands, num_tokens, compute_ms, on_host)
        ready_ms = self.now + max(stall_ms, host_ms - compute_ms)
        counters = self.counters
        counters.resident_ms += compute_ms
        counters.stall_ms += ready_ms - self.now
        self._advance(ready_ms)
        end_ms = ready_ms + compute_ms
        self._advance(end_ms)
        self.device.unpin([key for key in needed if key not in on_host] if on_host else needed)
        if held and self.host is not None:
            self.host.unpin(held)
        self.now = end_ms

    def wait_until(self, until_ms: float) -> None:
        """Idle until until_ms (other ranks or the network hold the step); the links keep moving."""
        if until_ms > self.now:
            self._advance(until_ms)
            self.now = until_ms

    def _stall_ms(self, needed: list[ExpertKey], lands: dict[ExpertKey, float], num_tokens: int,
                  compute_ms: float, on_host: list[ExpertKey] = ()) -> float:
        """How long the layer waits for expert bytes. Its routed experts (but those on_host) compute
        routed_expert_ms each (times their mean rows, and never more than the layer's compute in all) in the
        config's expert_order, each once it has landed: the wait is what that compute does not cover.
        "loaded", or no routed_expert_ms: until the last one lands."""
        now, order = self.now, self.config.expert_order
        rows = num_tokens * self.topology.top_k / max(len(needed), 1)  # a rank of several may need none
        expert_ms = min(self.cost.routed_expert_ms * rows, compute_ms / max(len(needed), 1))
        if expert_ms == 0.0 or order == "loaded" or not lands:
            return max([now, *lands.values()]) - now
        if order == "ready":  # resident first, then as they land
            starts = [now] * (len(needed) - len(on_host) - len(lands)) + sorted(lands.values())
        else:  # "given": in the layer's order, waiting for each
            starts = [lands.get(key, now) for key in needed if key not in on_host]
        waited, done = 0.0, now
        for landed in starts:
            if landed > done:
                waited += landed - done
                done = landed
            done += expert_ms
        return waited

    def _gather(self, layer: int, needed: list[ExpertKey], expert_ids) -> tuple[dict, list, float, list]:
        """The core's lookups (pinning the layer's experts); start demand loads. Returns when each expert not
        in place lands, the misses the host computes, the host lane's time for them and those of them it
        holds in the host tier (the others it reads from disk)."""
        on_host, host_ms, held = [], 0.0, []
        if self.host_compute is None:
            late, missed = self.core.fetch_layer(needed)
        else:
            placed = self.host_compute.fetch_layer(self.core, needed, expert_ids, self._in_host, self.core.moving)
            late, missed, on_host, host_ms = placed.late, placed.missed, placed.on_host, placed.host_ms
            held = [key for key in on_host if key not in placed.from_disk]
            self._compute_on_host(held)
            self.counters.host_computed += len(placed.from_disk)
        lands, demands = {}, set(missed)
        for key in late:
            transfer = self.core.moving[key]
            if transfer.stage != QUEUED:
                lands[key] = self._wait(transfer)
                continue
            self.core.untrack(key)  # a prefetch still queued: the demand load replaces it (in its slot)
            transfer.stage = DROPPED
            self._release(transfer)
            demands.add(key)
        if demands:
            keys = [key for key in needed if key in demands]
            lands.update(zip(keys, self._load_on_demand(keys)))
        self.counters.layers.hits[layer] += len(needed) - len(missed) - len(on_host)
        self.counters.layers.accesses[layer] += len(needed)
        return lands, on_host, host_ms, held

    def _in_host(self, key: ExpertKey) -> bool:
        """key's bytes are ready in host memory (every expert is when host DRAM holds them all)."""
        return self._host_ready(key) if self.host is not None else self.cost.host_holds_all

    def _compute_on_host(self, keys: list[ExpertKey]) -> None:
        """The host computes keys from its slots: each a host-tier hit, pinned there until the layer ends."""
        counters = self.counters
        counters.host_computed += len(keys)
        counters.host_accesses += len(keys)
        counters.host_hits += len(keys)
        if self.host is not None:
            for key in keys:
                self.host.access(key)
            self.host.pin(keys)

    def _load_on_demand(self, keys: list[ExpertKey]) -> list[float]:
        """Load keys ahead of every prefetch (slots reserved now; keys may be reordered); when each lands."""
        counters = self.counters
        counters.demand_fetches += len(keys)
        if self.host is not None:
            keys.sort(key=lambda k: not self._host_ready(k))
            return [self._demand(Transfer(key, False)) for key in keys]
        if self.cost.host_holds_all:
            counters.host_accesses += len(keys)
            counters.host_hits += len(keys)
        return self.device_link.commit_many(len(keys), self.now, self.cost.demand_batch_ms)  # before it computes

    def _demand(self, transfer: Transfer) -> float:
        """A demand load through the host tier; when it lands."""
        self.core.track(transfer.key, transfer)
        earliest = self._through_host(transfer)
        transfer.stage = MOVING
        return self.device_link.commit(transfer, earliest)

    def _through_host(self, transfer: Transfer) -> float:
        """A demand load's host stage: when its expert is ready in the host tier."""
        key, counters = transfer.key, self.counters
        counters.host_accesses += 1
        self._pin_host(transfer)
        if self._host_ready(key):
            counters.host_hits += 1
            self.host.access(key)
            return self.now
        self._admit_host(transfer, demand=True)
        transfer.stage = LOWER
        transfer.lower_end_ms = self.lower_link.commit(transfer, self.now)
        return transfer.lower_end_ms

    def _wait(self, transfer: Transfer) -> float:
        """A needed expert already on its way: hurry it if it still waits for the device link."""
        if transfer.prefetch and not transfer.waited:
            transfer.waited = True
            self.counters.late_prefetches += 1
        if transfer.stage == MOVING:
            return transfer.end_ms
        if transfer.stage == WAITING:
            self.device_link.waiting.remove(transfer)
        transfer.stage = MOVING
        return self.device_link.commit(transfer, max(self.now, transfer.lower_end_ms))

    def _plan(self, layer_now: int, predictions: list[Prediction]) -> None:
        """The planner's requests for what is predicted now, admitted by the core and queued by priority."""
        if layer_now < 0 and not predictions:
            return  # nothing new before the first layer: the last layer's plan stands
        if not predictions:
            self.core.end_plan()
            return
        view = self.core.plan_view(layer_now, self.topology.num_layers)
        requests = sorted(self.driver.plan(predictions, view), key=lambda r: -r.priority)
        priorities = {r.key: r.priority for r in requests}
        brought = self.core.admit_prefetches([r.key for r in requests])
        for key in priorities.keys() - set(brought):  # queued already: its rank follows the new plan
            transfer = self.core.moving.get(key)
            if transfer is not None and transfer.stage == QUEUED and transfer.priority != priorities[key]:
                transfer.priority = priorities[key]
                self._link_for(key).plan(transfer, again=True)
        for key in brought:
            transfer = Transfer(key, True, priorities[key])
            self.core.track(key, transfer)
            self._link_for(key).plan(transfer)
        for link in self.links:
            link.wake(self.now)

    def _link_for(self, key: ExpertKey) -> Link:
        """Where a prefetch waits: the device link, or the lower one while its host copy is missing."""
        return self.device_link if self.host is None or self._host_ready(key) else self.lower_link

    def _advance(self, until_ms: float) -> None:
        """Run the links up to until_ms: land what ends by then, start queued prefetches."""
        if self.lower_link is not None:
            self._run_lower(until_ms)
        link = self.device_link
        if not (link.running or link.planned or link.waiting):
            return
        while True:
            done = link.completed(until_ms)
            if done:
                self._land(done)
            if link.free_ms > until_ms:
                return
            transfer = link.next_planned()
            if transfer is None:
                return
            self._start_on_device(transfer)

    def _start_on_device(self, transfer: Transfer) -> None:
        link, key = self.device_link, transfer.key
        arrived = transfer.stage == WAITING
        if not arrived and self.host is not None and not self._host_ready(key):
            self.lower_link.plan(transfer)  # its host copy was evicted after the plan: read it again
            return
        if self.host is not None and not transfer.host_pinned:
            self._pin_host(transfer)
            self.host.access(key)
        if not arrived:
            self.counters.prefetches_started += 1
        transfer.stage = MOVING
        link.commit(transfer, transfer.lower_end_ms if arrived else link.free_ms)

    def _run_lower(self, until_ms: float) -> None:
        link = self.lower_link
        while True:
            for transfer in link.completed(until_ms):
                self.host_loading.discard(transfer.key)
                if transfer.stage == LOWER:
                    transfer.stage = WAITING
                    self.device_link.waiting.append(transfer)
                else:  # displaced on its way: the host keeps the copy
                    self._release(transfer)
            if link.free_ms > until_ms:
                return
            transfer = link.next_planned()
            if transfer is None:
                return
            if not self._admit_host(transfer, demand=False):
                link.plan(transfer, again=True)  # every host slot is in use: it waits
                return
            self._pin_host(transfer)
            self.counters.prefetches_started += 1
            transfer.stage = LOWER
            transfer.lower_end_ms = link.commit(transfer, link.free_ms)

    def _land(self, done: list[Transfer]) -> None:
        for transfer in done:
            if self.core.landed(transfer.key, transfer) and transfer.prefetch:
                self.counters.prefetches_landed += 1
            self._release(transfer)

    def _displaced(self, transfer: Transfer) -> None:
        """The core evicted the transfer's expert: dropped if it has not started; one on the lower link
        ends there (the host keeps it); one moving up lands before the link's next transfer."""
        if transfer.stage == QUEUED:
            self.counters.prefetches_dropped += 1
        elif transfer.stage == WAITING:
            self.device_link.waiting.remove(transfer)
        if transfer.stage != MOVING:
            if transfer.stage != LOWER:
                self._release(transfer)
            transfer.stage = DROPPED

    def _release(self, transfer: Transfer) -> None:
        """The host pin a transfer holds, given back."""
        if transfer.host_pinned:
            self.host.unpin((transfer.key,))
            transfer.host_pinned = False

    def _admit_host(self, transfer: Transfer, demand: bool) -> bool:
        try:
            self.host.admit(transfer.key)
        except CacheFullError:
            if demand:
                raise BudgetError(f"host tier of {self.host.capacity} slots has no expert to evict") from None
            return False
        self.host_loading.add(transfer.key)
        return True

    def _pin_host(self, transfer: Transfer) -> None:
        self.host.pin((transfer.key,))
        transfer.host_pinned = True

    def _host_ready(self, key: ExpertKey) -> bool:
        return key in self.host and key not in self.host_loading


@PROTOCOLS.register("stream")
class StreamProtocol(Protocol):
    """The discrete-event simulation of a serving stream under a cost model."""

    def run(self, policy: Policy, trace: Trace, config: SimConfig) -> dict:
        simulator = StreamSimulator(policy, config)
        counters = simulator.run(REPLAYS[config.mode](trace, config))
        return counters.summary(simulator.device_link.name)
