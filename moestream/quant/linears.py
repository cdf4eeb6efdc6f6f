"""Per-linear quantized layouts (compressed-tensors, GPTQ, FP8): `LinearCodec`, the codec methods they share.
A family's dense part, e.g. gate_up_proj made of w1 then w3, becomes one slot part per (linear, quantized
tensor), named "{param}.{linear}.{role}"; decoding writes linear j's rows of the dense weight. Knows no
format's arithmetic, no family and no runtime."""

from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import torch

from moestream.errors import CheckpointError
from moestream.families.base import ExpertPart

WEIGHT = ".weight"
Layout = Mapping[str, tuple[int, ...]]


class LinearCodec:
    """A subclass gives `method`, `roles` (slot role -> disk suffix of each quantized tensor of a linear), `marker`
    (the role marking a quantized dense linear), `linear_shape` ([out, in] of the linear "{param}.{j}") and
    `decode_linear` (writes that linear into its target's first rows and says how many)."""

    method: ClassVar[str]
    marker: ClassVar[str]
    roles: Mapping[str, str]

    def linear_shape(self, layout: Layout, prefix: str) -> tuple[int, int]:
        raise NotImplementedError

    def decode_linear(self, parts: Mapping[str, torch.Tensor], prefix: str, target: torch.Tensor) -> int:
        raise NotImplementedError

    def disk_parts(self, parts: Sequence[ExpertPart]) -> tuple[ExpertPart, ...]:
        """Each dense part's linears, each as one part per role."""
        found = []
        for part in parts:
            if part.fused_on_disk:
                raise CheckpointError(f"{self.method} experts fused over experts on disk ({part.disk[0]}) "
                                      "are not supported")
            for j, template in enumerate(part.disk):
                if not template.endswith(WEIGHT):
                    raise CheckpointError(f"{self.method} experts need per-expert linear weights; "
                                          f"{template!r} is not one")
                base = template[: -len(WEIGHT)]
                found += [ExpertPart(f"{part.param}.{j}.{role}", (f"{base}.{end}",))
                          for role, end in self.roles.items()]
        return tuple(found)

    def dense_shapes(self, layout: Layout) -> dict[str, tuple[int, int]]:
        """Per dense param: its linears' [out, in] shapes stacked on out."""
        shapes = {}
        for param in dict.fromkeys(name.rsplit(".", 2)[0] for name in layout):
            each = [self.linear_shape(layout, f"{param}.{j}") for j in linear_numbers(layout, param)]
            shapes[param] = (sum(s[0] for s in each), each[0][1])
        return shapes

    def decode(self, parts: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every dense param of `out`: its linears decoded in order into consecutive rows."""
        for param, weight in out.items():
            row, j = 0, 0
            while row < weight.shape[0]:
                row, j = row + self.decode_linear(parts, f"{param}.{j}", weight[row:]), j + 1
        return dict(out)

    def dense_groups(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """"{stem}.weight" -> {role: "{stem}.{suffix}"} of each stem with a `marker` tensor (absent roles left out)."""
        present, suffix = set(names), f".{self.roles[self.marker]}"
        groups = {}
        for name in names:
            if name.endswith(suffix):
                stem = name[: -len(suffix)]
                groups[f"{stem}{WEIGHT}"] = {role: f"{stem}.{end}" for role, end in self.roles.items()
                                             if f"{stem}.{end}" in present}
        return groups

    def decode_dense(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One quantized dense linear ({role: tensor}) -> its [O, I] weight in `dtype`, decoded as an expert's."""
        parts = {f"dense.0.{role}": tensor for role, tensor in tensors.items()}
        out = torch.empty(self.linear_shape({name: tuple(t.shape) for name, t in parts.items()}, "dense.0"),
                          dtype=dtype)
        self.decode_linear(parts, "dense.0", out)
        return out


def linear_numbers(layout: Layout, param: str) -> list[int]:
    """The linears j of the slot parts "{param}.{j}.{role}" of a layout, in order."""
    return sorted({int(name.rsplit(".", 2)[1]) for name in layout if name.rsplit(".", 2)[0] == param})
