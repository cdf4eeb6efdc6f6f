"""Stops generation at the first NaN or infinity in an expert layer's output or in the logits.

Damaged weights otherwise decode as silent garbage (argmax over NaN logits is token 0). `FiniteFlags`
writes one flag per checked tensor on the device, read with the logits, so the check adds no wait; the
first bad place is named (its cost: `moestream bench integrity`). `check_finite` checks one tensor at
once. Knows tensors, not checkpoints, tiers or policies.
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
        self.places, self.reads = places, reads
        self._flags = torch.ones(len(places) + 1, dtype=torch.bool, device=device)  # the last: the logits

    @classmethod
    def of_layers(cls, moe_layer_ids, device: torch.device | str, reads: HostReads) -> "FiniteFlags":
        return cls(layer_places(moe_layer_ids), device, reads)

    def mark(self, place: int, values: torch.Tensor) -> torch.Tensor:
        """Returns values unchanged; their flag says whether all are finite (no wait)."""
        self._flags[place].logical_and_(torch.isfinite(values).all())
        return values

    def begin(self) -> None:
        self._flags.fill_(True)  # a step that raised may have left one false

    def read(self, logits: torch.Tensor, *more: torch.Tensor) -> tuple[np.ndarray | torch.Tensor, ...]:
        """The logits [B, V] on the host (float32 tensor) and `more` (numpy) in one read; raises for the first
        place of the step that was not finite."""
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
