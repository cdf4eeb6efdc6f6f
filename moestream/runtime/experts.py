"""How transformers reaches the offloaded experts: the "moestream" experts implementation, the
module swap for families without registry support, and the router taps that feed gate probabilities.

`ExpertsInterface.register("moestream", ...)` adds our forward to transformers' experts registry. Each
bound experts module carries a `LayerBinding` (its MoE-layer index and the `OffloadedExperts`). Where
every expert is resident and unobserved, the forward is transformers' own over `ResidentExperts`, views
of the slot pool. Families whose experts are not registry-dispatched get a replacement module from
`EXPERT_SWAPS` (by the original class name). A block's shared experts run as it starts (`LaunchedFirst`).
Nothing here knows a policy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from moestream.registry import Registry
from moestream.runtime.expert_math import FusedExpertMath
from moestream.runtime.offload import OffloadedExperts
from moestream.runtime.replay import RoutingReplay

IMPLEMENTATION = "moestream"
BINDING_ATTR = "moestream_binding"


@dataclass(frozen=True)
class LayerBinding:
    layer: int  # MoE-layer index
    experts: OffloadedExperts
    replay: RoutingReplay | None = None  # a recorded trace's routing replaces the router's (measurement only)
    native: str | None = None  # the experts implementation the model had (all resident, it runs again)


class ResidentExperts:
    """An experts module whose weights [E, ...] are the layer's views of the slot pool (no copy)."""

    def __init__(self, module: torch.nn.Module, weights: dict[str, torch.Tensor]):
        self._module, self._weights = module, weights

    def __getattr__(self, name: str):
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_module"], name)


def _binding(module: torch.nn.Module) -> LayerBinding:
    binding = getattr(module, BINDING_ATTR, None)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} uses the {IMPLEMENTATION!r} experts implementation "
                           "but was not bound to a moestream runtime")
    return binding


def moestream_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H]."""
    binding = _binding(self)
    if binding.replay is not None:
        active = binding.experts.publisher.rows(hidden_states.shape[0]).active  # [T] bool
        top_k_index, top_k_weights = binding.replay.route(binding.layer, active, top_k_index, top_k_weights)
    resident = binding.experts.resident_weights(binding.layer)  # every expert in place, no one observing
    if resident is not None:  # transformers' own experts forward over the pool: no read, the same tokens
        forward = ALL_EXPERTS_FUNCTIONS.get_interface(binding.native or "grouped_mm", type(self).forward.__wrapped__)
        with binding.experts.tracer.span("experts", lambda: f"layer {binding.layer}: all resident, in one call"):
            out = forward(ResidentExperts(self, resident), hidden_states, top_k_index, top_k_weights)
        binding.experts.count_resident(top_k_index)
        return binding.experts.finite.mark(binding.layer, out)
    return binding.experts.forward(binding.layer, FusedExpertMath(self), hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, moestream_experts_forward)

EXPERT_SWAPS: Registry[torch.nn.Module] = Registry("experts module swap")


@EXPERT_SWAPS.register("SwitchTransformersExperts")
class OneHotDenseExperts(torch.nn.Module):
    """Replaces SwitchTransformers' ModuleDict of `expert_{e}` MLPs (wi, act, wo), called with a one-hot
    dispatch mask (a row of zeros: a dropped token)."""

    def __init__(self, original: torch.nn.ModuleDict, binding: LayerBinding):
        super().__init__()
        first = original["expert_0"]
        self.act = first.act  # the activation module, also the `act` stage of the expert math
        self.num_experts = len(original)
        self.moestream_binding = binding

    # the expert math in stages (an `ExpertMath`): wi per expert, the activation over many experts' rows, wo
    def up(self, hidden: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.linear(hidden.to(weights["wi"].dtype), weights["wi"])  # [n, d_ff]

    def down(self, inner: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.linear(inner.to(weights["wo"].dtype), weights["wo"])  # [n, H]

    def post(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, H], selected_experts [N, 1, E] one-hot, routing_weights [N, 1] -> [N, H]."""
        top_k_index = selected_experts.argmax(dim=-1)  # [N, 1]
        kept = selected_experts.sum(dim=(-1, -2)) > 0  # [N]
        binding = self.moestream_binding
        return binding.experts.forward(binding.layer, self, hidden_states, top_k_index, routing_weights, kept)


def find_router(block: torch.nn.Module, experts_name: str, num_experts: int, hidden_size: int):
    """The module of an MoE block whose weight maps hidden states to one logit per expert, or None."""
    for name, module in block.named_modules():
        if name == experts_name or name.startswith(f"{experts_name}."):
            continue
        weight = module._parameters.get("weight")
        if weight is not None and tuple(weight.shape) == (num_experts, hidden_size):
            return module
    return None


class RouterTap:
    """A forward hook on a router that hands its logits [T, E] to the experts mechanism."""

    def __init__(self, experts: OffloadedExperts, layer: int, num_experts: int):
        self.experts = experts
        self.layer = layer
        self.num_experts = num_experts

    def __call__(self, module, args, output) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for value in outputs:
            if torch.is_tensor(value) and value.is_floating_point() and value.shape[-1] == self.num_experts:
                self.experts.record_router_logits(self.layer, value.detach().reshape(-1, self.num_experts))
                return


SHARED_NAMES = ("shared_experts", "shared_expert")  # a MoE block's shared experts, as transformers names them


class LaunchedFirst(torch.nn.Module):
    """A MoE block's shared experts, run as the block starts (a pre-hook) so the device computes them while
    the host waits for the routing; the block's call on the same rows gets that result (the same bits)."""

    def __init__(self, shared: torch.nn.Module):
        super().__init__()
        self.shared = shared
        self._early: tuple[torch.Tensor, torch.Tensor] | None = None  # (the block's input, its result)

    def launch(self, block: torch.nn.Module, args: tuple) -> None:
        if args and torch.is_tensor(args[0]) and args[0].is_contiguous():
            self._early = (args[0], self.shared(args[0]))

    def done(self, *hook_args) -> None:
        self._early = None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        early, self._early = self._early, None
        if early is None or args or kwargs or not _same_rows(early[0], x):
            return self.shared(x, *args, **kwargs)
        return early[1].view(*x.shape[:-1], early[1].shape[-1])


def _same_rows(first: torch.Tensor, x: torch.Tensor) -> bool:
    return (x.is_contiguous() and x.data_ptr() == first.data_ptr() and x.shape[-1] == first.shape[-1]
            and x.numel() == first.numel())


def launch_shared_first(block: torch.nn.Module) -> list:
    """Swaps the block's shared experts for a `LaunchedFirst`; the hooks' handles."""
    for name in SHARED_NAMES:
        shared = getattr(block, name, None)
        if isinstance(shared, torch.nn.Module):
            first = LaunchedFirst(shared)
            setattr(block, name, first)
            return [block.register_forward_pre_hook(first.launch),
                    block.register_forward_hook(first.done, always_call=True)]
    return []


def bind_experts(model: torch.nn.Module, checkpoint, experts: OffloadedExperts, tap_routers: bool) -> list:
    """Points every MoE layer's experts at `experts` (registry or swap); returns the hooks' handles."""
    adapter, hooks = checkpoint.adapter, []
    num_experts = checkpoint.topology.num_experts
    hidden_size = model.config.get_text_config().hidden_size
    native = getattr(model.config, "_experts_implementation", None)
    for block in checkpoint.blocks:
        parent_path, _, name = block.experts_path.rpartition(".")
        parent = model.get_submodule(parent_path)
        binding = LayerBinding(block.moe_index, experts, native=native if native != IMPLEMENTATION else None)
        if adapter.uses_experts_registry:
            setattr(parent.get_submodule(name), BINDING_ATTR, binding)
        else:
            original = parent.get_submodule(name)
            setattr(parent, name, EXPERT_SWAPS.create(type(original).__name__, original, binding))
        hooks += launch_shared_first(parent)
        router = find_router(parent, name, num_experts, hidden_size) if tap_routers else None
        if router is not None:
            hooks.append(router.register_forward_hook(RouterTap(experts, block.moe_index, num_experts)))
    if adapter.uses_experts_registry:
        model.set_experts_implementation(IMPLEMENTATION)
    return hooks


def attach_replay(model: torch.nn.Module, replay: RoutingReplay) -> int:
    """Makes every registry-bound experts module follow the replay; how many modules were bound."""
    bound = 0
    for module in model.modules():
        binding = getattr(module, BINDING_ATTR, None)
        if binding is not None and not isinstance(module, OneHotDenseExperts):
            setattr(module, BINDING_ATTR, dataclasses.replace(binding, replay=replay))
            bound += 1
    return bound
