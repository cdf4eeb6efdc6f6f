"""Preallocated expert slots of one tier.

A pool is one [num_slots, stride] uint8 tensor allocated once; slot(i) is a 1-D view of
slot_bytes. The stride is slot_bytes rounded up to SLOT_ALIGN_BYTES so that every slot starts
aligned for any dtype view and for vectorised device loads. Host pools that feed a CUDA device are
pinned so copies can be asynchronous; a pool remembers, per slot, the event of the last copy that
reads it (`moestream.store.streams`), so that the host never overwrites a slot a copy still reads.
Pools know no experts, keys or policies.
"""

from __future__ import annotations

import torch

from moestream.store.streams import Event

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
        self._last_reads: list[Event | None] = [None] * num_slots
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

    def mark_read(self, i: int, event: Event) -> None:
        """Record that an asynchronous copy reading slot i completes at event."""
        self._last_reads[i] = event

    def wait_reads(self, i: int) -> None:
        """Block until asynchronous copies reading slot i are done, before the host overwrites it."""
        event, self._last_reads[i] = self._last_reads[i], None
        if event is not None:
            event.synchronize()
