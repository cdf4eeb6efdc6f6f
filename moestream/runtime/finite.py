"""Stops generation at the first NaN or infinity in an expert layer's output or in the logits.

Damaged weights (bytes flipped on disk, a NaN in a tensor) otherwise decode as silent garbage:
argmax over NaN logits is token 0. One reduction per checked tensor and step; its cost per token
is printed by `moestream bench integrity`. This module knows tensors and where they came from, not
checkpoints, tiers or policies.
"""

from __future__ import annotations

import torch

from moestream.errors import MoestreamError


class NonFiniteError(MoestreamError):
    """NaN or infinite values in a model's activations: most likely damaged weights."""


def check_finite(values: torch.Tensor, where: str) -> torch.Tensor:
    """Returns values unchanged; raises NonFiniteError naming `where` if any is NaN or infinite."""
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteError(f"non-finite values (NaN or inf) in {where}: the checkpoint's weights are "
                             "probably damaged; download them again, or compare them with their published "
                             "sha256 (`moestream verify --model DIR` does for a Hugging Face cache snapshot)")
    return values
