"""Preallocated expert slots of one tier, and the single copy that moves an expert between tiers.

A pool is one [num_slots, stride] uint8 tensor allocated once; slot(i) is a 1-D view of
slot_bytes. The stride is slot_bytes rounded up to SLOT_ALIGN_BYTES so that every slot starts
aligned for any dtype view and for vectorised device loads. Host pools that feed a CUDA device are
pinned so copies can be asynchronous. On CUDA a move is one `copy_(non_blocking=True)` on a
dedicated copy stream, fenced against the compute stream both ways; on the CPU it is a plain copy
and no CUDA API is touched. Pools know no experts, keys or policies.
"""

from __future__ import annotations

import torch

SLOT_ALIGN_BYTES = 256


def slot_stride(slot_bytes: int) -> int:
    return -(-slot_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


class SlotPool:
    def __init__(self, num_slots: int, slot_bytes: int, device: str | torch.device = "cpu", pin_memory: bool = False):
        if num_slots < 0 or slot_bytes < 1:
            raise ValueError(f"need num_slots >= 0 and slot_bytes >= 1, got {num_slots}, {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.device = torch.device(device)
        self.pinned = bool(pin_memory) and self.device.type == "cpu"
        shape = (num_slots, slot_stride(slot_bytes))
        self.data = torch.empty(shape, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)  # [S, stride]
        self._last_reads: list[torch.cuda.Event | None] = [None] * num_slots
        self._slots: list[torch.Tensor | None] = [None] * num_slots  # views made once, asked for per layer

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def slot(self, i: int) -> torch.Tensor:
        """Slot i as a 1-D uint8 view of slot_bytes (no copy)."""
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range for a pool of {self.num_slots}")
        view = self._slots[i]
        if view is None:
            view = self._slots[i] = self.data[i, : self.slot_bytes]  # [slot_bytes]
        return view

    def mark_read(self, i: int, event: "torch.cuda.Event | None") -> None:
        """Record that an asynchronous copy reading slot i completes at event."""
        self._last_reads[i] = event

    def wait_reads(self, i: int) -> None:
        """Block until asynchronous copies reading slot i are done, before the host overwrites it."""
        event, self._last_reads[i] = self._last_reads[i], None
        if event is not None:
            event.synchronize()


class CopyEngine:
    """Copies a slot into a slot of another tier: one copy per expert."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> "torch.cuda.Event | None":
        """dst <- src. On CUDA, ordered after the compute stream's pending work (which may still read
        dst) and before its later work; returns the event marking completion (None on the CPU)."""
        if self._stream is None:
            dst.numpy()[:] = src.numpy()  # a plain memcpy: no intra-op threads for one slot
            return None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(done)
        return done

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
