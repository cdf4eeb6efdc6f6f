"""Where each expert's bytes are on disk and how a slot's bytes are viewed as compute tensors: plain data the
checkpoint indexer fills from safetensors headers, the store copies into slots and the runtime views as weights."""

from __future__ import annotations

import collections
import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from moestream.topology import ExpertKey, Topology


@dataclass(frozen=True)
class Segment:
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class ExpertLocation:
    key: ExpertKey
    segments: tuple[Segment, ...]  # in slot order; concatenated they form the slot's bytes

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def residue(self, block: int) -> int:
        """The slot start modulo block that makes most bytes congruent to their file offsets (for O_DIRECT)."""
        congruent: collections.Counter = collections.Counter()  # residue -> bytes it makes congruent
        starts = itertools.accumulate((seg.nbytes for seg in self.segments), initial=0)
        for seg, at in zip(self.segments, starts):
            congruent[(seg.offset - at) % block] += seg.nbytes
        return max(congruent, key=congruent.__getitem__)


@dataclass(frozen=True)
class PartView:
    param: str  # e.g. "gate_up_proj"
    shape: tuple[int, ...]  # per-expert shape, e.g. (2 * I, H)
    dtype: torch.dtype
    offset: int  # byte offset in the slot
    transposed: bool = False  # the bytes hold the shape's last two dimensions swapped (as the disk does)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExpertIndex:
    topology: Topology
    locations: dict[ExpertKey, ExpertLocation]
    layout: tuple[PartView, ...]  # the same for every expert of the model

    def views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of one slot (1-D uint8), no copy: the slot viewed once per dtype, each part strided from that."""
        typed = {dtype: slot[: slot.numel() - slot.numel() % dtype.itemsize].view(dtype)
                 for dtype in {dtype for _, dtype, *_ in self._strided}}
        return {param: typed[dtype].as_strided(shape, strides, typed[dtype].storage_offset() + start)
                for param, dtype, shape, strides, start in self._strided}

    @functools.cached_property
    def _strided(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], int], ...]:
        """Per part: name, dtype, shape, contiguous strides and first element in the slot's typed view."""
        return tuple((p.param, p.dtype, p.shape, _strides(p), p.offset // p.dtype.itemsize) for p in self.layout)

    def residue(self, key: ExpertKey, block: int) -> int:
        """ExpertLocation.residue of key, or 0 where that start would misalign a view of the slot."""
        residue = self.locations[key].residue(block)
        widest = max(p.dtype.itemsize for p in self.layout)
        return residue if residue % widest == 0 else 0


def _strides(part: PartView) -> tuple[int, ...]:
    """A part's strides in its slot: contiguous, or the transpose of its contiguous disk layout."""
    if not part.transposed:
        return torch.empty(part.shape, device="meta").stride()
    return torch.empty(part.shape, device="meta").transpose(-2, -1).contiguous().transpose(-2, -1).stride()


class ExpertCheck(Protocol):
    """One expert's bytes checked as they are read, in slot order, in host memory (never a device slot)."""

    @property
    def done(self) -> bool:
        """Every byte of the expert has been checked."""

    def update(self, data: torch.Tensor) -> None:
        """The expert's next bytes (1-D uint8 on the CPU); raises a CheckpointError naming a damaged piece."""


class Integrity(Protocol):
    """Checks experts' bytes just read from disk, where the read put them in host memory."""

    def begin(self, key: ExpertKey) -> ExpertCheck:
        """The check of key's bytes, fed as they are read."""
