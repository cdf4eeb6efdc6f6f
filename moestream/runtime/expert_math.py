"""What an expert MLP computes, in stages, over typed views of its slot: the `ExpertMath` contract and
`FusedExpertMath`, the computation of a transformers experts module (`@use_experts_implementation`),
read from the module's own flags, gate and activation. Its grouped projections are the ones
transformers' `grouped_mm_experts_forward` runs. Knows no store, slot layout or policy.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

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


@runtime_checkable
class GroupedExpertMath(Protocol):
    """An `ExpertMath` whose projections also run grouped: x [R, in] sorted by group, stacked weights
    [G, ...], offs [G] cumulative row counts (int32), groups [R] each row's group -> [R, out]."""

    def up_grouped(self, x: torch.Tensor, stacked: Weights, offs: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        ...

    def down_grouped(self, x: torch.Tensor, stacked: Weights, offs: torch.Tensor,
                     groups: torch.Tensor) -> torch.Tensor:
        ...


def grouped_mm():
    """torch's grouped matrix product (F.grouped_mm, else torch._grouped_mm), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)  # [N, out]
    return out if bias is None else out + bias


class FusedExpertMath:
    """The computation of a transformers experts module, as in `grouped_mm_experts_forward`."""

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

    def up_grouped(self, x: torch.Tensor, stacked: Weights, offs: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return self._project_grouped(x, stacked, offs, groups, self.up_name)  # [R, 2I] or [R, I]

    def down_grouped(self, x: torch.Tensor, stacked: Weights, offs: torch.Tensor,
                     groups: torch.Tensor) -> torch.Tensor:
        return self._project_grouped(x, stacked, offs, groups, "down_proj")  # [R, H]

    def _project(self, x: torch.Tensor, weights: Weights, name: str) -> torch.Tensor:
        bias = weights[f"{name}_bias"] if self.module.has_bias else None
        return _linear(x.to(weights[name].dtype), weights[name], bias, self.module.is_transposed)

    def _project_grouped(self, x: torch.Tensor, stacked: Weights, offs: torch.Tensor, groups: torch.Tensor,
                         name: str) -> torch.Tensor:
        weight = stacked[name]  # [G, out, in], or [G, in, out] when transposed
        weight = weight if self.module.is_transposed else weight.transpose(-2, -1)
        out = grouped_mm()(x.to(weight.dtype), weight, offs=offs)  # [R, out]
        return out + stacked[f"{name}_bias"][groups] if self.module.has_bias else out
