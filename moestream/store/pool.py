"""Preallocated expert slots of one tier: one [num_slots, stride] uint8 tensor allocated once.

Device pools round the stride up to SLOT_ALIGN_BYTES (aligned for any dtype view). Host pools start
every row at a block boundary with one block to spare: slot(i, residue) starts `residue` bytes into
its row, so that O_DIRECT reads land in place (`moestream.store.disk`); they are pinned where they
feed a CUDA device. A pool remembers, per slot, the event of its last reader and of its last write:
whatever overwrites a slot waits for the first, whatever reads it for the second. Pools know no
experts, keys or policies.
"""

from __future__ import annotations

import torch

from moestream.store.disk import BLOCK_BYTES
from moestream.store.streams import Event

SLOT_ALIGN_BYTES = 256


class SlotPool:
    def __init__(self, num_slots: int, slot_bytes: int, device: str | torch.device = "cpu", pin_memory: bool = False):
        if num_slots < 0 or slot_bytes < 1:
            raise ValueError(f"need num_slots >= 0 and slot_bytes >= 1, got {num_slots}, {slot_bytes}")
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.device = torch.device(device)
        self.pinned = bool(pin_memory) and self.device.type == "cpu"
        self.block = BLOCK_BYTES if self.device.type == "cpu" else 1  # residues are taken modulo this
        align = max(self.block, SLOT_ALIGN_BYTES)
        stride = -(-slot_bytes // align) * align + (self.block if self.block > 1 else 0)  # one block to spare
        flat = torch.empty(num_slots * stride + align, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
        start = (-flat.data_ptr()) % align
        self.data = flat[start : start + num_slots * stride].view(num_slots, stride)  # [S, stride]
        self._last_reads: list[Event | None] = [None] * num_slots
        self._last_writes: list[Event | None] = [None] * num_slots
        self._slots: list[tuple[int, torch.Tensor] | None] = [None] * num_slots  # (shift, view) last asked for

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def slot(self, i: int, residue: int = 0) -> torch.Tensor:
        """Slot i, a 1-D uint8 view of slot_bytes starting at `residue` modulo the block (host pools only)."""
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range for a pool of {self.num_slots}")
        shift, last = residue % self.block, self._slots[i]
        if last is None or last[0] != shift:
            last = self._slots[i] = (shift, self.data[i, shift : shift + self.slot_bytes])  # [slot_bytes]
        return last[1]

    def release(self) -> None:
        """Frees the slots' memory now (the store closed), not when the garbage collector next finds the
        store's callbacks' cycles; a slot asked for after it raises IndexError."""
        self.num_slots = 0
        self.data = self.data.new_empty((0, self.data.shape[1]))  # [0, stride]: a new, empty storage
        self._slots, self._last_reads, self._last_writes = [], [], []

    def mark_read(self, i: int, event: Event | None) -> None:
        """Record that the last reader of slot i (an asynchronous copy, or compute) completes at event."""
        self._last_reads[i] = event

    def last_read(self, i: int) -> Event | None:
        """The event of slot i's last reader (None: none recorded), which whatever overwrites it waits for."""
        return self._last_reads[i]

    def mark_written(self, i: int, event: Event | None) -> None:
        """Record that the bytes now in slot i are in place at event (None: they are already)."""
        self._last_writes[i] = event

    def written(self, i: int) -> Event | None:
        """The event at which slot i's bytes are in place, which whatever reads them waits for."""
        return self._last_writes[i]

    def wait_reads(self, i: int) -> None:
        """Block until asynchronous copies reading slot i are done, before the host overwrites it."""
        event, self._last_reads[i] = self._last_reads[i], None
        if event is not None:
            event.synchronize()
