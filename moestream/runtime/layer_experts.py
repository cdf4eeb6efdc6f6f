"""A MoE layer's routed experts in one call: every expert's MLP over its rows, from typed views of its slot.

The caller sorts the layer's used (token, k) rows by expert, opens a kernel over them, `add`s each
expert's slot views and row span as its bytes land, calls `flush` before releasing them, and takes the
weighted rows, scattered to their (token, k) places, from `result` (once). Kernels (`LAYER_KERNELS`):
"stream" (CPU default) computes each expert as it is added, overlapping the bytes still landing, and
runs the row-wise tail once per layer; "grouped" (CUDA default) runs each projection of the collected
experts as one grouped GEMM over a strided view of their evenly spaced slots, else streams them;
"per-expert" is the former path, kept as the bench's reference.

Exactness: each expert's products see exactly the rows transformers' grouped_mm gives it, activation and
post are row-wise, and the caller sums over k as transformers does, whatever the arrival order. fp32
weights whose slot start is not 16-byte aligned are computed from an aligned copy: MKL's gemv rounds
differently on such addresses (4- and 8-byte offsets change the last bits; 16, 32 and 64 do not).
Quantized experts (`LayerRows.decode`) are decoded into reusable scratch right before their MLP, one at
a time. Knows no store, policy, family or quantization format.
"""

from __future__ import annotations

import math as _math
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from moestream.registry import Registry
from moestream.runtime.expert_math import ExpertMath, GroupedExpertMath, Weights, grouped_mm
from moestream.runtime.host_reads import upload

ALIGN_BYTES = 16  # fp32 weights at other addresses are copied (see the module docstring)


@dataclass(frozen=True)
class LayerRows:
    math: ExpertMath
    inputs: torch.Tensor  # [R, H] hidden state of each used (token, k) row, sorted by expert
    scale: torch.Tensor  # [R, 1] routing weight of each row
    order: torch.Tensor  # [R] place of each row among the S = T * K (token, k) rows
    num_rows: int  # S
    out_dtype: torch.dtype  # of the [S, H] result
    decode: Callable[[Weights], Weights] | None = None  # quantized slot views -> dense weights (scratch)

    def weights(self, views: Weights) -> Weights:
        return views if self.decode is None else self.decode(views)

    def mlp(self, views: Weights, start: int, end: int) -> torch.Tensor:
        """One expert's MLP without post over its sorted rows [start, end) -> [n, H]; by the decode's own
        `mlp(math, rows, views)` where it has one (quant/kernels.py)."""
        own = getattr(self.decode, "mlp", None)
        if own is not None:
            return own(self.math, self.inputs[start:end], views)
        return expert_mlp(self.math, self.inputs[start:end], self.weights(views))


class LayerExperts(Protocol):
    def add(self, weights: Weights, start: int, end: int) -> None:
        """One expert's slot views and its rows [start, end) of the sorted rows."""

    def flush(self) -> None:
        """Computes whatever was added and not yet computed (before the caller releases those experts)."""

    def result(self) -> torch.Tensor:
        """[S, H]: each used row's weighted expert output in its (token, k) place, unused rows zero."""


LAYER_KERNELS: Registry[LayerExperts] = Registry("layer experts kernel")


def aligned(weights: Weights) -> Weights:
    """The views, each misaligned fp32 one copied aligned (exactness, see above)."""
    if all(w.dtype != torch.float32 or w.data_ptr() % ALIGN_BYTES == 0 for w in weights.values()):
        return weights
    return {name: w.clone() if w.dtype == torch.float32 and w.data_ptr() % ALIGN_BYTES else w
            for name, w in weights.items()}


def expert_mlp(math: ExpertMath, rows: torch.Tensor, weights: Weights) -> torch.Tensor:
    """One expert's MLP without its post stage: [n, H] -> [n, H]."""
    weights = aligned(weights)
    return math.down(math.act(math.up(rows, weights)), weights)


def zeros(rows: LayerRows) -> torch.Tensor:
    return torch.zeros(rows.num_rows, rows.inputs.shape[-1], dtype=rows.out_dtype, device=rows.inputs.device)


def scattered(rows: LayerRows, weighted: torch.Tensor) -> torch.Tensor:
    """[R, H] weighted rows -> [S, H] in their (token, k) places, unused rows zero."""
    return zeros(rows).index_copy_(0, rows.order, weighted.to(rows.out_dtype))


@LAYER_KERNELS.register("stream")
class StreamedLayer:
    """Each expert's products and activation as it is added; post, weighting and scatter once."""

    def __init__(self, rows: LayerRows):
        self.rows = rows
        self.outputs: torch.Tensor | None = None  # [R, H], filled expert by expert

    def add(self, weights: Weights, start: int, end: int) -> None:
        self.put(slice(start, end), self.rows.mlp(weights, start, end))

    def put(self, where: slice | torch.Tensor, out: torch.Tensor) -> None:
        if self.outputs is None:
            self.outputs = out.new_empty(self.rows.inputs.shape[0], out.shape[-1])  # [R, H]
        self.outputs[where] = out

    def flush(self) -> None:
        pass  # every expert was computed when added

    def result(self) -> torch.Tensor:
        if self.outputs is None:
            return zeros(self.rows)  # no used rows
        return scattered(self.rows, self.rows.math.post(self.outputs) * self.rows.scale)


@LAYER_KERNELS.register("per-expert")
class PerExpertLayer:
    """The former path: each expert's whole MLP, weighting and scatter when it is added."""

    def __init__(self, rows: LayerRows):
        self.rows = rows
        self.out = zeros(rows)  # [S, H]

    def add(self, weights: Weights, start: int, end: int) -> None:
        r = self.rows
        out = r.math.post(r.mlp(weights, start, end)) * r.scale[start:end]  # [n, H]
        self.out[r.order[start:end]] = out

    def flush(self) -> None:
        pass

    def result(self) -> torch.Tensor:
        return self.out


def stacked(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One [G, ...] strided view over tensors of one storage spaced evenly apart (G >= len(views); groups
    without rows cost nothing), or None where they are not."""
    first = views[0]
    offsets = [v.storage_offset() for v in views]
    low = min(offsets)
    step = 0
    for offset in offsets:
        step = _math.gcd(step, offset - low)
    step = step or first.numel()
    groups = (max(offsets) - low) // step + 1
    same = all(v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for v in views)
    strides = (step, *(stride for stride in first.stride() if stride != 1))
    misaligned = any(stride * first.element_size() % ALIGN_BYTES for stride in strides) or (
        min(v.data_ptr() for v in views) % ALIGN_BYTES)
    if not same or misaligned or step < first.numel():  # groups would overlap: not one view per slot
        return None
    return first.as_strided((groups, *first.shape), (step, *first.stride()), low)


def grouped_ready(device: torch.device) -> bool:
    """Whether torch has a grouped GEMM here: CUDA of capability 8.0 or later, or a CPU with torch >= 2.9."""
    if grouped_mm() is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 9)


@dataclass(frozen=True)
class Groups:
    """Where each of the collected experts lies in the stacked views of their slots."""

    stacked: Weights  # name -> [G, ...]
    of_expert: list[int]  # group of each collected expert

    @classmethod
    def of(cls, experts: list[Weights]) -> "Groups | None":
        stacks = {name: stacked([w[name] for w in experts]) for name in experts[0]}
        if any(s is None for s in stacks.values()):
            return None
        of_expert = None
        for name, stack in stacks.items():
            step = stack.stride(0)
            found = [(w[name].storage_offset() - stack.storage_offset()) // step for w in experts]
            if of_expert is not None and found != of_expert:
                return None
            of_expert = found
        return cls(stacks, of_expert)


@LAYER_KERNELS.register("grouped")
class GroupedLayer:
    """`add` collects; `flush` runs them as grouped GEMMs over strided views of their slots, else streams."""

    def __init__(self, rows: LayerRows):
        self.rows = rows
        self.stream = StreamedLayer(rows)
        self.pending: list[tuple[Weights, int, int]] = []

    def add(self, weights: Weights, start: int, end: int) -> None:
        self.pending.append((weights, start, end))

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        groups = Groups.of([w for w, _, _ in pending]) if pending and self._can_group() else None
        if groups is None:
            for weights, start, end in pending:
                self.stream.add(weights, start, end)
            return
        self._run(groups, pending)

    def result(self) -> torch.Tensor:
        return self.stream.result()

    def _can_group(self) -> bool:
        rows = self.rows  # quantized experts stream: each is decoded into the one scratch right before its MLP
        return rows.decode is None and isinstance(rows.math, GroupedExpertMath) and grouped_ready(rows.inputs.device)

    def _run(self, groups: Groups, pending: list[tuple[Weights, int, int]]) -> None:
        """The rows by group, their groups and offsets are built on the device from the spans (no read)."""
        device = self.rows.inputs.device
        ranked = sorted(range(len(pending)), key=groups.of_expert.__getitem__)  # experts in group order
        spans = np.array([(pending[i][1], pending[i][2] - pending[i][1], groups.of_expert[i]) for i in ranked])
        starts, lengths, group = upload(spans.astype(np.int64), device).unbind(1)  # [m] each
        num_rows = int(spans[:, 1].sum())
        row_groups = torch.repeat_interleave(group, lengths, output_size=num_rows)  # [n]
        before = lengths.cumsum(0) - lengths  # [m] rows of the experts ahead in group order
        perm = torch.repeat_interleave(starts - before, lengths, output_size=num_rows) + torch.arange(
            num_rows, device=device)  # [n] the sorted rows, by group
        counts = torch.zeros(num_groups(groups), dtype=torch.int64, device=device).index_add_(0, group, lengths)
        offs = counts.cumsum(0).to(torch.int32)  # [G]
        math = self.rows.math
        inner = math.act(math.up_grouped(self.rows.inputs[perm], groups.stacked, offs, row_groups))
        self.stream.put(perm, math.down_grouped(inner, groups.stacked, offs, row_groups))  # [n, H]


def num_groups(groups: Groups) -> int:
    return next(iter(groups.stacked.values())).shape[0]


def default_kernel(device: torch.device) -> str:
    """The LAYER_KERNELS name for a device: "grouped" on CUDA with a grouped GEMM, else "stream"."""
    return "grouped" if device.type == "cuda" and grouped_ready(device) else "stream"
