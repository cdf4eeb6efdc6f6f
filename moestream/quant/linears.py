"""Expert parts of per-linear quantized layouts (compressed-tensors, GPTQ): a family's dense part, e.g.
gate_up_proj made of w1 then w3, becomes one slot part per (linear, quantized tensor), named
"{param}.{linear}.{role}"; decoding writes linear j's rows of the dense weight. Knows no format's
arithmetic, no family and no runtime.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from moestream.errors import CheckpointError
from moestream.families.base import ExpertPart

WEIGHT = ".weight"


def part_name(param: str, linear: int, role: str) -> str:
    return f"{param}.{linear}.{role}"


def stem(template: str, method: str) -> str:
    """A dense linear's disk name without ".weight" (e.g. "experts.{expert}.w1")."""
    if not template.endswith(WEIGHT):
        raise CheckpointError(f"{method} experts need per-expert linear weights; {template!r} is not one")
    return template[: -len(WEIGHT)]


def linear_parts(parts: Sequence[ExpertPart], roles: Sequence[str], names: Mapping[str, str],
                 method: str) -> tuple[ExpertPart, ...]:
    """Each dense part's linears, each as one part per role; `names` maps a role to its disk suffix."""
    found = []
    for part in parts:
        if part.fused_on_disk:
            raise CheckpointError(f"{method} experts fused over experts on disk ({part.disk[0]}) are not supported")
        for j, template in enumerate(part.disk):
            base = stem(template, method)
            found += [ExpertPart(part_name(part.param, j, role), (f"{base}.{names[role]}",)) for role in roles]
    return tuple(found)


def linears(layout: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Dense param -> how many linears fill it, from the slot part names of `linear_parts`."""
    count: dict[str, int] = {}
    for name in layout:
        param, linear, _ = name.rsplit(".", 2)
        count[param] = max(count.get(param, 0), int(linear) + 1)
    return count


def dense_shapes(layout: Mapping[str, tuple[int, ...]],
                 shape_of: Callable[[Mapping[str, tuple[int, ...]], str], tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Per dense param: its linears' [out, in] shapes (shape_of(layout, "{param}.{j}")) stacked on out."""
    shapes = {}
    for param, count in linears(layout).items():
        each = [shape_of(layout, f"{param}.{j}") for j in range(count)]
        shapes[param] = (sum(s[0] for s in each), each[0][1])
    return shapes


def decode_linears(parts: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor],
                   decode_one: Callable[[Mapping[str, torch.Tensor], str, torch.Tensor], int]) -> dict[str, torch.Tensor]:
    """Every dense param of `out`: its linears decoded in order into consecutive rows (decode_one writes
    linear "{param}.{j}" into the first rows of its target and says how many)."""
    for param, weight in out.items():
        row, j = 0, 0
        while row < weight.shape[0]:
            prefix = f"{param}.{j}"
            rows = decode_one(parts, prefix, weight[row:])
            row, j = row + rows, j + 1
    return dict(out)


def dense_groups(names: Sequence[str], roles: Mapping[str, str], marker: str) -> dict[str, dict[str, str]]:
    """Quantized dense linears among disk names: "{stem}.weight" -> {role: "{stem}.{suffix}"} for every stem
    that has a `marker` tensor (roles: role -> disk suffix; roles whose tensor is absent are left out)."""
    present = set(names)
    suffix = f".{roles[marker]}"
    groups = {}
    for name in names:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            groups[f"{stem}{WEIGHT}"] = {role: f"{stem}.{end}" for role, end in roles.items() if f"{stem}.{end}" in present}
    return groups


def decode_dense(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 shape_of: Callable[[Mapping[str, tuple[int, ...]], str], tuple[int, int]],
                 decode_one: Callable[[Mapping[str, torch.Tensor], str, torch.Tensor], int]) -> torch.Tensor:
    """One quantized dense linear ({role: tensor}) -> its [O, I] weight in `dtype`, by a codec's per-linear
    shape and decoding (the same as an expert linear's)."""
    parts = {f"dense.0.{role}": tensor for role, tensor in tensors.items()}
    out = torch.empty(shape_of({name: tuple(t.shape) for name, t in parts.items()}, "dense.0"), dtype=dtype)
    decode_one(parts, "dense.0", out)
    return out
