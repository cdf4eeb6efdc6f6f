"""One MoE layer's experts, served from the expert store: the engine's expert path in one place.

`OffloadedExperts.forward`, in order: the routing comes to the host in the layer's one read (`HostReads`)
and is published (the event is built only when some observer overrides `Observer.observe`); the layer's
experts are fetched (pinned; misses ahead of speculative work); the policy plans later layers' prefetch
(`Prefetcher`: it only queues transfers, never waits for bytes); then the experts compute, resident ones
first, the others as they land (`reorder=False`: in expert order), as one `LayerExperts` kernel whose
weighted rows land in a [T * K, H] buffer summed over k as transformers does. No expert's result depends
on the order of arrival, so outputs are bit-identical. Experts beyond the device tier run in groups that
fit it. Under expert parallelism a `Shard` says which experts this process owns: only their rows are
computed, and the shard combines every process's rows before the sum. Knows no policy or family by name.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from moestream.link_model import LinkFigures, ModelledLink
from moestream.policies.driver import PolicyDriver
from moestream.runtime.expert_math import ExpertMath, Weights
from moestream.runtime.finite import FiniteFlags, check_finite, layer_places
from moestream.runtime.host_compute import HostCompute
from moestream.runtime.host_reads import HostReads, upload
from moestream.runtime.layer_experts import LAYER_KERNELS, Groups, LayerRows, default_kernel, num_groups
from moestream.runtime.publisher import Publisher, Routing
from moestream.runtime.sharding import Shard
from moestream.topology import ExpertKey
from moestream.tracer import LaneTotal, Tracer, since


class Prefetcher:
    """After a layer's routing: the driver's transfer requests for the layers ahead (owned ones, under a shard)."""

    def __init__(self, driver: PolicyDriver, store, shard: Shard | None = None):
        self.driver = driver
        self.store = store
        self.shard = shard

    def after(self, layer_now: int) -> None:
        requests = self.driver.decide(layer_now, self.store.plan_view)  # the driver reports its time
        if self.shard is not None:
            requests = [request for request in requests if self.shard.owns(request.key)]
        if requests:
            self.store.prefetch(requests)
        elif layer_now >= 0:  # an empty plan ends the last one too (before the first layer it stands)
            self.store.end_plan()


def modelled_link(config, topology) -> ModelledLink | None:
    """The planner's model of the disk link from EngineConfig.link_gbps and layer_ms (None without both)."""
    if config.link_gbps <= 0 or config.layer_ms <= 0:
        return None
    return LinkFigures(config.link_gbps, config.layer_ms, config.reorder).model(topology)


class RowPlan:
    """A layer's used (token, k) rows [R of S = T * K], stably sorted by expert id: the order on the device
    (built there from the device's ids), each expert's span on the host (from the ids it read)."""

    def __init__(self, ids: np.ndarray, used: np.ndarray, device_ids: torch.Tensor, num_experts: int):
        self.num_rows = ids.size
        self._counts = np.bincount(ids[used], minlength=num_experts)  # [E]
        self._ends = ends = np.cumsum(self._counts)  # [E]
        key = device_ids if used.all() else device_ids.masked_fill(~upload(used, device_ids.device), num_experts)
        self.order = torch.argsort(key, stable=True)[: int(ends[-1])]  # [R] on the device

    def span(self, expert: int) -> tuple[int, int]:
        end = int(self._ends[expert])
        return end - int(self._counts[expert]), end


def expert_compute(now: dict[str, LaneTotal], before: dict[str, LaneTotal]) -> tuple[int, float]:
    """The expert MLPs run between two `Tracer.totals()` copies and the seconds of lanes "experts" and
    "layer" (the layers' expert work), for calibrating the simulator (`bench fidelity`)."""
    experts = since(now, before, "experts")
    return experts.spans, experts.seconds + since(now, before, "layer").seconds


class _CheckedAtOnce:
    """FiniteFlags' `mark` that checks at once (an `OffloadedExperts` used outside an engine)."""

    def __init__(self, moe_layer_ids, reads: HostReads):
        self.places, self.reads = layer_places(moe_layer_ids), reads

    def mark(self, layer: int, values: torch.Tensor) -> torch.Tensor:
        return check_finite(values, self.places[layer], self.reads)


class OffloadedExperts:
    """The mechanism behind every bound experts module of a model."""

    def __init__(self, store, publisher: Publisher, prefetcher: Prefetcher | None = None, reorder: bool = True,
                 kernel: str | None = None, decode: Callable[[Weights], Weights] | None = None,
                 shard: Shard | None = None, tracer: Tracer | None = None, reads: HostReads | None = None,
                 finite: FiniteFlags | None = None):
        """decode: a quantized slot's views -> dense weights (None: unquantized); tracer: where expert MLPs
        (lane "experts") and other expert work ("layer") are reported; finite: where each layer's output is
        checked (None: at once, in its own read)."""
        self.reads = reads if reads is not None else HostReads()
        self.finite = finite if finite is not None else _CheckedAtOnce(store.topology.moe_layer_ids, self.reads)
        self.store = store
        self.decode = decode
        self.shard = shard  # None: every expert is computed here
        self.host: HostCompute | None = None  # where misses held in the host tier may compute (--host-compute)
        self.publisher = publisher
        self.prefetcher = prefetcher
        self.reorder = reorder
        self.kernel = kernel  # a LAYER_KERNELS name; None: the device's default
        self.tracer = tracer if tracer is not None else Tracer()
        self._router_logits: dict[int, torch.Tensor] = {}
        self._resident: dict[int, Weights | None] = {}  # layer -> its [E, ...] views (None: not evenly laid out)
        self.resident_hits = torch.zeros((), dtype=torch.int64, device=store.config.device)  # the step's
        self._views: OrderedDict[int, Weights] = OrderedDict()  # slot address -> typed views, least recent first
        self._max_views = 2 * max(store.device_slots, 1)  # a slot's address moves with its expert's file offset

    def resident_weights(self, layer: int) -> Weights | None:
        """The layer's experts as [E, ...] views of the device pool where all are resident, unobserved,
        unquantized, unsharded and evenly laid out in expert order; else None (the offloaded path runs)."""
        if self.shard is not None or self.decode is not None or self.publisher.observed:
            return None
        if layer not in self._resident:
            slots = self.store.resident_layer(layer)
            if slots is None:
                return None  # not yet (or never) all resident: asked again next time
            groups = Groups.of([self._slot_views(slot) for slot in slots])
            aligned = groups is not None and groups.of_expert == list(range(len(slots)))
            self._resident[layer] = groups.stacked if aligned and num_groups(groups) == len(slots) else None
        return self._resident[layer]

    def count_resident(self, top_k_index: torch.Tensor) -> None:
        """Counts on the device the distinct experts an all-resident layer used (its lookups)."""
        num_experts, active = self.store.topology.num_experts, self.publisher.rows(top_k_index.shape[0]).active
        ids = top_k_index if active.all() else top_k_index.masked_fill(  # [T, K]
            ~upload(active, top_k_index.device)[:, None], num_experts)
        used = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device).index_fill_(0, ids.reshape(-1), True)
        self.resident_hits += used[:num_experts].sum()

    def take_resident_hits(self, hits) -> int:
        """The step's count, read (with the logits); the device's counter starts again."""
        count = int(hits)  # before the reset: on the CPU, the read is the counter's own memory
        self.resident_hits.zero_()
        return count

    def take_host_computed(self) -> int:
        return self.host.take_count() if self.host is not None else 0

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    def record_router_logits(self, layer: int, logits: torch.Tensor) -> None:
        self._router_logits[layer] = logits

    def forward(self, layer: int, math: ExpertMath, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H], top_k_index/top_k_weights [T, K], kept [T] bool (False: dropped) -> [T, H]."""
        rows = self.publisher.rows(hidden.shape[0])
        num_tokens, top_k = top_k_index.shape
        if self.host is not None and self.host.costs is None:
            self.host.calibrate(math, hidden, self.decode)
        routing, kept_rows = self._read(layer, hidden, top_k_index, top_k_weights, kept)  # the layer's one read
        active = rows.active if kept_rows is None else rows.active & kept_rows  # [T] bool
        if routing.weights is not None:  # 1. routing published
            self.publisher.publish(layer, routing, rows, active)
        ids = routing.expert_ids.reshape(-1)  # [S = T * K]
        used = np.repeat(active, top_k)  # [S]
        if self.shard is not None:
            used &= self.shard.owned_rows(layer, ids)  # the other rows are other processes'
        keys = [ExpertKey(layer, int(e)) for e in np.unique(ids[used])]
        counts = {int(e): int(n) for e, n in zip(*np.unique(ids[used], return_counts=True))}  # rows by expert
        on_host = self.host.place(keys, counts) if self.host is not None else {}  # pinned
        groups = self.store.streaming_groups([key for key in keys if key not in on_host] if on_host else keys)
        chosen = [key for group in groups for key in group]
        try:
            first = self.store.fetch(groups[0], chosen) if groups else None  # 2. this layer's misses first
        except BaseException:
            if on_host:
                self.host.release(on_host)
            raise
        try:
            if self.prefetcher is not None:
                self.prefetcher.after(layer)  # 3. transfers of later layers planned and queued
            plan = RowPlan(ids, used, top_k_index.reshape(-1), self.store.topology.num_experts)
            out = self._compute(math, hidden, top_k_weights, plan, groups, first, on_host)  # 4. compute: [S, H]
        finally:
            if first is not None:
                first.release()
        if self.shard is not None:
            out = self.shard.combine(layer, out)  # [S, H], each row from the one process that owns its expert
        return self.finite.mark(layer, out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype))  # [T, H]

    def _read(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              kept: torch.Tensor | None) -> tuple[Routing, np.ndarray | None]:
        """The layer's routing on the host in one read: ids, kept rows and, where observed, what observers read
        (weights None: no one observes)."""
        logits = self._router_logits.pop(layer, None)
        observed = self.publisher.observed
        wanted = {"ids": top_k_index, "kept": kept}
        if observed:
            wanted |= {"weights": top_k_weights.float(), "hidden": hidden if self.publisher.needs_hidden else None,
                       "probs": None if logits is None else torch.softmax(logits.float(), -1)}
        names = [name for name, tensor in wanted.items() if tensor is not None]
        read = dict(zip(names, self.reads.read(*(wanted[name] for name in names))))
        routing = Routing(read["ids"], read.get("weights"), read.get("hidden"), read.get("probs"))
        return routing, read.get("kept")

    def _compute(self, math: ExpertMath, hidden: torch.Tensor, top_k_weights: torch.Tensor, plan: RowPlan,
                 groups: list[list[ExpertKey]], first, on_host: dict[ExpertKey, torch.Tensor]) -> torch.Tensor:
        """Every used (token, k) row through its expert, weighted -> [S, H] (unused rows zero); on_host's
        experts compute on the host meanwhile."""
        order = plan.order  # [R]
        top_k = plan.num_rows // hidden.shape[0]
        rows = LayerRows(math, hidden[order // top_k], top_k_weights.reshape(-1)[order, None], order,
                         plan.num_rows, torch.promote_types(hidden.dtype, top_k_weights.dtype), self.decode)
        kernel = self.kernel or default_kernel(hidden.device)
        spans = {key.expert: plan.span(key.expert) for key in on_host}
        work = self.host.start(on_host, math, rows, spans, default_kernel(torch.device("cpu"))) if on_host else None
        out = self._on_device(rows, plan, kernel, groups, first)
        if work is not None:
            with self.tracer.span("host compute", lambda: f"layer {work.keys[0].layer}: {len(work.keys)} experts"):
                out = torch.where(work.mask[:, None], work.result(out.device), out)
        return out

    def _on_device(self, rows: LayerRows, plan: RowPlan, kernel: str, groups: list[list[ExpertKey]],
                   first) -> torch.Tensor:
        layer = LAYER_KERNELS.create(kernel, rows)
        for number, group in enumerate(groups):
            fetch = first if number == 0 else self.store.fetch(group, [key for g in groups for key in g])
            try:
                for key, slot in fetch.ready(self.reorder):
                    with self.tracer.span("experts", lambda: f"layer {key.layer} expert {key.expert}"):
                        layer.add(self._slot_views(slot), *plan.span(key.expert))
                with self.tracer.span("layer", lambda: f"layer {group[0].layer}: flush of {len(group)} experts"):
                    layer.flush()
            finally:
                fetch.release()
        with self.tracer.span("layer", "the layer's weighting and scatter"):
            return layer.result()  # [S, H]

    def _slot_views(self, slot: torch.Tensor) -> Weights:
        """Typed views of a slot, cached by address for the most recent ones."""
        address = slot.data_ptr()
        views = self._views.get(address)
        if views is None:
            views = self._views[address] = self.store.index.views(slot)
            if len(self._views) > self._max_views:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(address)
        return views
