"""A stand-in for the checkpoint's manifest (`Integrity`): it sees each expert's bytes as the store's reads
deliver them, records where in memory each chunk lay, and finds the experts it is told are damaged."""

import torch

from moestream.errors import CheckpointError
from moestream.topology import ExpertKey


class RecordingIntegrity:
    def __init__(self, expert_bytes: int, damaged: tuple[ExpertKey, ...] = ()):
        self.expert_bytes, self.damaged = expert_bytes, set(damaged)
        self.checked: list[ExpertKey] = []  # experts in the order their first bytes were checked
        self.chunks: list[tuple[ExpertKey, int, int]] = []  # (expert, address, bytes) of each chunk checked

    def begin(self, key: ExpertKey) -> "RecordingCheck":
        return RecordingCheck(self, key)


class RecordingCheck:
    def __init__(self, owner: RecordingIntegrity, key: ExpertKey):
        self.owner, self.key, self.seen = owner, key, 0

    @property
    def done(self) -> bool:
        return self.seen == self.owner.expert_bytes

    def update(self, data: torch.Tensor) -> None:
        assert data.device.type == "cpu" and data.dtype == torch.uint8 and data.dim() == 1
        if not self.seen:
            self.owner.checked.append(self.key)
        self.owner.chunks.append((self.key, data.data_ptr(), data.numel()))
        self.seen += data.numel()
        if self.key in self.owner.damaged:
            raise CheckpointError(f"expert {tuple(self.key)} is damaged")
