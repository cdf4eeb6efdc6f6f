"""One MoE layer's experts, served from the expert store: publish the routing, fetch, compute, prefetch.

The routing event is built only when some observer overrides `Observer.observe` (reactive
policies, e.g. plain LRU, read none, and building it costs as much as a layer's bookkeeping).

Experts run in any order: those already in the device tier first, then the misses, fetched on
demand (synchronously) in groups that fit the device tier. The layer's (token, k) rows are sorted
by expert in that order, so that gathering inputs, weighting and scattering outputs are one
operation each, as in transformers' `grouped_mm` experts forward. Within a group, each expert's
projections are one matmul over its rows, from typed views of its slot, and the activation and
post-expert norm run once over the group's rows (`ExpertMath` gives these stages with the
semantics of the experts module it replaces). Outputs are combined as transformers combines them
(per (token, k) rows, weighted, then summed over k). After a layer, the policy may predict and the
store prefetch. This module knows no policy or family by name.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from moestream.policies.contracts import CacheView, Observer
from moestream.policies.driver import PolicyDriver
from moestream.runtime.finite import check_finite
from moestream.runtime.publisher import Publisher, Routing
from moestream.topology import ExpertKey

Weights = dict[str, torch.Tensor]  # one expert's parameters by name: typed views of its slot


class ExpertMath(Protocol):
    """An expert MLP in stages: `up` and `down` per expert, `act` and `post` over many experts' rows."""

    def up(self, hidden: torch.Tensor, weights: Weights) -> torch.Tensor:
        """[n, H] rows of one expert -> [n, U] (U: 2I for gated experts)."""

    def act(self, up: torch.Tensor) -> torch.Tensor:
        """[N, U] -> [N, I], row by row."""

    def down(self, inner: torch.Tensor, weights: Weights) -> torch.Tensor:
        """[n, I] rows of one expert -> [n, H]."""

    def post(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, H], row by row."""


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)  # [N, out]
    return out if bias is None else out + bias


class FusedExpertMath:
    """The computation of a transformers experts module (`@use_experts_implementation`), read from
    the module's own flags, gate and activation, as in `grouped_mm_experts_forward`."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.up_name = "gate_up_proj" if module.has_gate else "up_proj"

    def up(self, hidden: torch.Tensor, weights: Weights) -> torch.Tensor:
        return self._project(hidden, weights, self.up_name)  # [n, 2I] or [n, I]

    def act(self, up: torch.Tensor) -> torch.Tensor:
        m = self.module
        return m._apply_gate(up) if m.has_gate else m.act_fn(up)  # [N, I]

    def down(self, inner: torch.Tensor, weights: Weights) -> torch.Tensor:
        return self._project(inner, weights, "down_proj")  # [n, H]

    def post(self, out: torch.Tensor) -> torch.Tensor:
        m = self.module
        return m.post_expert_norm(out) if getattr(m, "has_post_expert_norm", False) else out

    def _project(self, x: torch.Tensor, weights: Weights, name: str) -> torch.Tensor:
        bias = weights[f"{name}_bias"] if self.module.has_bias else None
        return _linear(x.to(weights[name].dtype), weights[name], bias, self.module.is_transposed)


class Prefetcher:
    """After a layer's routing: the driver's transfer requests for the layers ahead, into the device tier."""

    def __init__(self, driver: PolicyDriver, store):
        self.driver = driver
        self.store = store

    def after(self, layer_now: int) -> None:
        requests = self.driver.decide(layer_now, self._view)
        if requests:
            self.store.prefetch(requests)

    def _view(self, layer_now: int) -> CacheView:
        return CacheView(
            resident=self.store.resident(),
            in_flight=self.store.in_flight(),
            capacity=self.store.device_slots,
            layer_now=layer_now,
            num_layers=self.store.topology.num_layers,
        )


def _observes(observer) -> bool:
    """Whether an observer handles routing events (`Observer.observe` itself ignores them), so that a
    layer builds its event only when someone reads it."""
    return getattr(observer.observe, "__func__", None) is not Observer.observe


def _routing(active: np.ndarray, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Routing:
    """The routing of the active rows (no indexing when every row is active, the common case)."""
    if active.all():
        return Routing(torch.arange(active.size, device=top_k_index.device), top_k_index, top_k_weights)
    picked = torch.from_numpy(np.flatnonzero(active)).to(top_k_index.device)  # [R]
    return Routing(picked, top_k_index[picked], top_k_weights[picked])


class RowPlan:
    """A layer's used (token, k) rows [R of S = T * K], sorted by expert in a given expert order."""

    def __init__(self, ids: np.ndarray, used: np.ndarray, expert_order: list[int]):
        rows = np.flatnonzero(used)  # [R]
        rank = np.zeros(int(ids.max(initial=0)) + 1, dtype=np.int64)
        rank[expert_order] = np.arange(len(expert_order))
        self.num_rows = ids.size
        self.order = rows[np.argsort(rank[ids[rows]], kind="stable")]  # [R]
        counts = np.bincount(ids[rows], minlength=rank.size)[expert_order]
        ends = np.cumsum(counts).tolist()
        self._spans = {e: (end - int(n), end) for e, n, end in zip(expert_order, counts, ends)}

    def span(self, expert: int) -> tuple[int, int]:
        """Where the expert's rows lie in the sorted order."""
        return self._spans[expert]


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class OffloadedExperts:
    """The mechanism behind every bound experts module of a model."""

    def __init__(self, store, publisher: Publisher, prefetcher: Prefetcher | None = None):
        self.store = store
        self.publisher = publisher
        self.prefetcher = prefetcher
        self._router_logits: dict[int, torch.Tensor] = {}
        self._views: dict[int, Weights] = {}  # slot address -> typed views of the slot

    def record_router_logits(self, layer: int, logits: torch.Tensor) -> None:
        self._router_logits[layer] = logits

    def forward(self, layer: int, math: ExpertMath, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H], top_k_index/top_k_weights [T, K], kept [T] bool (False: dropped) -> [T, H]."""
        rows = self.publisher.rows(hidden.shape[0])
        active = rows.active if kept is None else rows.active & kept.cpu().numpy()  # [T] bool
        logits = self._router_logits.pop(layer, None)
        if any(map(_observes, self.publisher.observers)):
            self.publisher.publish(layer, _routing(active, top_k_index, top_k_weights), rows, hidden, logits)
        out = check_finite(self._compute(layer, math, hidden, top_k_index, top_k_weights, active),
                           f"the routed experts' output of MoE layer {layer} "
                           f"(decoder layer {self.store.topology.moe_layer_ids[layer]})")  # [T, H]
        if self.prefetcher is not None:
            self.prefetcher.after(layer)
        return out

    def _compute(self, layer: int, math: ExpertMath, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, active: np.ndarray) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1).cpu().numpy()  # [S]
        used = np.repeat(active, top_k)  # [S]
        groups = self.store.streaming_groups([ExpertKey(layer, int(e)) for e in np.unique(ids[used])])
        plan = RowPlan(ids, used, [key.expert for group in groups for key in group])
        order = torch.from_numpy(plan.order).to(hidden.device)  # [R]
        inputs = hidden[order // top_k]  # [R, H]
        routed = [self._run_group(group, math, inputs, plan) for group in groups]  # [n_g, H] each
        out_dtype = torch.promote_types(hidden.dtype, top_k_weights.dtype)
        out = torch.zeros(plan.num_rows, hidden.shape[-1], dtype=out_dtype, device=hidden.device)  # [S, H]
        if routed:
            out[order] = _cat(routed) * top_k_weights.reshape(-1)[order, None]
        return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)  # [T, H]

    def _run_group(self, group: list[ExpertKey], math: ExpertMath, inputs: torch.Tensor,
                   plan: RowPlan) -> torch.Tensor:
        """The group's rows [n, H] through its experts (held in the device tier meanwhile) -> [n, H]."""
        slots = self.store.acquire(group)
        try:
            views = [self._slot_views(slots[key]) for key in group]
            spans = [plan.span(key.expert) for key in group]
            start = spans[0][0]
            up = _cat([math.up(inputs[a:b], w) for (a, b), w in zip(spans, views)])  # [n, U]
            inner = math.act(up)  # [n, I]
            down = _cat([math.down(inner[a - start : b - start], w) for (a, b), w in zip(spans, views)])  # [n, H]
            return math.post(down)
        finally:
            self.store.release(group)

    def _slot_views(self, slot: torch.Tensor) -> Weights:
        """Typed views of a slot; slots are fixed memory, so a slot's views serve every expert it holds."""
        address = slot.data_ptr()
        if address not in self._views:
            self._views[address] = self.store.index.views(slot)
        return self._views[address]
