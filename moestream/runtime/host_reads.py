"""The one way the engine reads device tensors on the host, and the count of those reads.

A host read of a CUDA tensor drains the GPU's queue, so the engine reads once per MoE layer (its
routing) and once per step (logits and finite flags). `HostReads.read` copies every tensor of one read
into pinned buffers and waits once; `upload` sends host arrays to the device without waiting. Knows no
model, store or policy.
"""

from __future__ import annotations

import numpy as np
import torch


class HostReads:
    """Counts the engine's device-to-host reads (`count`; one per `read`, whatever it carries)."""

    def __init__(self):
        self.count = 0

    def read(self, *tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
        """Each tensor as a numpy array on the host, after one wait (bf16 and half are read as float32)."""
        self.count += 1
        wide = [t.detach().float() if t.dtype in (torch.bfloat16, torch.float16) else t.detach() for t in tensors]
        if all(t.device.type == "cpu" for t in wide):
            return tuple(t.numpy() for t in wide)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in wide]
        for buffer, tensor in zip(host, wide):
            buffer.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(next(t.device for t in wide if t.device.type == "cuda")))
        done.synchronize()  # the one wait
        return tuple(t.numpy() for t in host)


def upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on the device, copied from pinned memory without the host waiting for the copy."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
