"""One MoE layer's experts, served from the expert store: publish the routing, fetch, compute, prefetch.

Experts run in any order: those already in the device tier first, then the misses, fetched on
demand (synchronously) in groups that fit the device tier. Each expert computes from typed views
of its slot, with the semantics of the experts module it replaces (an `ExpertMath`); the outputs
are combined exactly as transformers' `batched_mm`/`grouped_mm` combine them (per (token, k)
rows, weighted, then summed over k). After a layer, the policy may predict and the store prefetch.
This module knows no policy or family by name.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from moestream.policies.base import CacheView, Policy
from moestream.runtime.publisher import Publisher, Routing
from moestream.topology import ExpertKey


class ExpertMath(Protocol):
    def __call__(self, hidden: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert's output [N, H] for its rows [N, H], given its weights (slot views by param name)."""


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)  # [N, out]
    return out if bias is None else out + bias


class FusedExpertMath:
    """The per-expert computation of a transformers experts module (`@use_experts_implementation`),
    read from the module's own flags, gate and activation, as in `batched_mm_experts_forward`."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.module
        up = "gate_up_proj" if m.has_gate else "up_proj"
        out = self._project(hidden, weights, up)  # [N, 2I] or [N, I]
        out = m._apply_gate(out) if m.has_gate else m.act_fn(out)  # [N, I]
        out = self._project(out, weights, "down_proj")  # [N, H]
        return m.post_expert_norm(out) if getattr(m, "has_post_expert_norm", False) else out

    def _project(self, x: torch.Tensor, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        bias = weights[f"{name}_bias"] if self.module.has_bias else None
        return _linear(x.to(weights[name].dtype), weights[name], bias, self.module.is_transposed)


class Prefetcher:
    """After a layer's routing: ask the policy's predictor, plan, and prefetch into the device tier."""

    def __init__(self, policy: Policy, store, horizon_layers: int):
        self.policy = policy
        self.store = store
        self.horizon_layers = horizon_layers

    def after(self, layer_now: int) -> None:
        if self.horizon_layers == 0:
            return
        predictions = self.policy.predictor.predict(layer_now, self.horizon_layers)
        if not predictions:
            return
        view = CacheView(
            resident=self.store.resident(),
            in_flight=self.store.in_flight(),
            capacity=self.store.device_slots,
            layer_now=layer_now,
            num_layers=self.store.topology.num_layers,
        )
        requests = self.policy.planner.plan(predictions, view)
        if requests:
            self.store.prefetch(requests)


class OffloadedExperts:
    """The mechanism behind every bound experts module of a model."""

    def __init__(self, store, publisher: Publisher, prefetcher: Prefetcher | None = None):
        self.store = store
        self.publisher = publisher
        self.prefetcher = prefetcher
        self._router_logits: dict[int, torch.Tensor] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # slot address -> typed views of the slot

    def record_router_logits(self, layer: int, logits: torch.Tensor) -> None:
        self._router_logits[layer] = logits

    def forward(self, layer: int, math: ExpertMath, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H], top_k_index/top_k_weights [T, K], kept [T] bool (False: dropped) -> [T, H]."""
        rows = self.publisher.rows(hidden.shape[0])
        active = torch.from_numpy(rows.active).to(hidden.device)  # [T]
        if kept is not None:
            active = active & kept
        picked = active.nonzero().squeeze(1)  # [R]
        routing = Routing(picked, top_k_index[picked], top_k_weights[picked])
        self.publisher.publish(layer, routing, rows, hidden, self._router_logits.pop(layer, None))
        out = self._compute(layer, math, hidden, top_k_index, top_k_weights, active)
        if self.prefetcher is not None:
            self.prefetcher.after(layer)
        return out

    def _compute(self, layer: int, math: ExpertMath, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1).cpu().numpy()  # [S], S = T * K
        used = active.repeat_interleave(top_k).cpu().numpy()  # [S]
        weights = top_k_weights.reshape(-1)  # [S]
        out_dtype = torch.promote_types(hidden.dtype, top_k_weights.dtype)
        out = torch.zeros(ids.size, hidden.shape[-1], dtype=out_dtype, device=hidden.device)  # [S, H]
        keys = [ExpertKey(layer, int(e)) for e in np.unique(ids[used])]

        def run(key: ExpertKey, views: dict[str, torch.Tensor]) -> None:
            sel = torch.from_numpy(np.flatnonzero((ids == key.expert) & used)).to(hidden.device)  # [n]
            out[sel] = math(hidden[sel // top_k], views) * weights[sel, None]

        self._each_expert(keys, run)
        return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)  # [T, H]

    def _slot_views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a slot; slots are fixed memory, so a slot's views serve every expert it holds."""
        address = slot.data_ptr()
        if address not in self._views:
            self._views[address] = self.store.index.views(slot)
        return self._views[address]

    def _each_expert(self, keys: list[ExpertKey], run: Callable[[ExpertKey, dict], None]) -> None:
        """Calls run(key, views) for every key, resident experts first, misses streamed in groups."""
        for group in self.store.streaming_groups(keys):
            slots = self.store.acquire(group)
            try:
                for key in group:
                    run(key, self._slot_views(slots[key]))
            finally:
                self.store.release(group)
