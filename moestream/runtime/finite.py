"""Stops generation at the first NaN or infinity in an expert layer's output or in the logits.

Damaged weights (bytes flipped on disk, a NaN in a tensor) otherwise decode as silent garbage:
argmax over NaN logits is token 0. One reduction per checked tensor and step; its cost per token
is printed by `moestream bench integrity`. In the engine (`FiniteFlags`) each reduction writes a flag
on the device, and the step's flags come to the host in one read with the logits, so the check adds
no wait of its own; the first bad place of the step is named. `check_finite` checks one tensor at
once. This module knows tensors and where they came from, not checkpoints, tiers or policies.
"""

from __future__ import annotations

import numpy as np
import torch

from moestream.errors import MoestreamError
from moestream.runtime.host_reads import HostReads


class NonFiniteError(MoestreamError):
    """NaN or infinite values in a model's activations: most likely damaged weights."""


def check_finite(values: torch.Tensor, where: str, reads: HostReads | None = None) -> torch.Tensor:
    """Returns values unchanged; raises NonFiniteError naming `where` if any is NaN or infinite (a read)."""
    (finite,) = (reads or HostReads()).read(torch.isfinite(values).all())
    if not finite:
        raise NonFiniteError(_message(where))
    return values


class FiniteFlags:
    """One step's finite checks on the device: `mark` writes a place's flag, `read` brings them to the
    host with the logits (one read) and raises for the first place marked non-finite."""

    def __init__(self, places: list[str], device: torch.device | str, reads: HostReads):
        """places: the words naming each flag's place (its index in `mark`)."""
        self.places, self.reads = places, reads
        self._flags = torch.ones(len(places) + 1, dtype=torch.bool, device=device)  # the last: the logits

    @classmethod
    def of_layers(cls, moe_layer_ids, device: torch.device | str, reads: HostReads) -> "FiniteFlags":
        """Flags for each MoE layer's routed experts' output (decoder layer ids given) and the logits."""
        return cls(layer_places(moe_layer_ids), device, reads)

    def mark(self, place: int, values: torch.Tensor) -> torch.Tensor:
        """Returns values unchanged; their flag says whether all are finite (no wait)."""
        self._flags[place].logical_and_(torch.isfinite(values).all())
        return values

    def begin(self) -> None:
        """A step starts: every flag true (a step that raised may have left one false)."""
        self._flags.fill_(True)

    def read(self, logits: torch.Tensor, *more: torch.Tensor) -> tuple[np.ndarray | torch.Tensor, ...]:
        """The logits [B, V] on the host (float32, a tensor) and `more` (numpy), in one read; raises for the
        first place of the step that was not finite."""
        self.mark(len(self.places), logits)
        host_logits, flags, *rest = self.reads.read(logits.float(), self._flags, *more)
        bad = np.flatnonzero(~flags)
        if bad.size:
            where = int(bad[0])
            raise NonFiniteError(_message(self.places[where] if where < len(self.places) else
                                          "the logits (the model's output head)"))
        return (torch.from_numpy(host_logits), *rest)


def layer_places(moe_layer_ids) -> list[str]:
    """The words naming each MoE layer's routed experts' output (decoder layer ids given)."""
    return [f"the routed experts' output of MoE layer {layer} (decoder layer {decoder})"
            for layer, decoder in enumerate(moe_layer_ids)]


def _message(where: str) -> str:
    return (f"non-finite values (NaN or inf) in {where}: the checkpoint's weights are probably damaged; download "
            "them again, or compare them with their published sha256 (`moestream verify --model DIR` does for a "
            "Hugging Face cache snapshot)")
