"""Per-expert digests of a checkpoint (`moestream-manifest.json`, written by `moestream verify`), and the
check of an expert's bytes against them: one xxh3-64 digest per piece of a slot (a whole tensor or one
expert's slice of a fused one), so a mismatch names the shard, the tensor and the expert. The store checks
bytes in slot order as its reads deliver them, in host memory only (`Manifest.begin`). Knows checkpoints'
files and tensors, not tiers, runtimes or policies."""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import xxhash

from moestream.atomic import write_json
from moestream.checkpoint.index import CheckpointIndex
from moestream.checkpoint.shards import TensorInfo
from moestream.errors import CheckpointError
from moestream.topology import ExpertKey

MANIFEST_FILE = "moestream-manifest.json"
FORMAT = "moestream-manifest"
VERSION = 1
HASH = "xxh3_64"


class IntegrityError(CheckpointError):
    """Bytes of a checkpoint that differ from their recorded digest."""


@dataclass(frozen=True)
class Piece:
    """Bytes [slot_offset, slot_offset + nbytes) of an expert's slot: all or part of one disk tensor."""

    tensor: str
    shard: str  # file name in the checkpoint directory
    file_offset: int
    slot_offset: int
    nbytes: int


def digest(data) -> int:
    """The xxh3-64 digest of a bytes-like object (a numpy array or memoryview too)."""
    return xxhash.xxh3_64_intdigest(data)


def expert_pieces(checkpoint: CheckpointIndex) -> dict[ExpertKey, tuple[Piece, ...]]:
    """Every expert's slot cut at the boundaries of the disk tensors it comes from."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in sorted(checkpoint.tensors.values(), key=lambda t: t.offset):
        by_file.setdefault(info.file, []).append(info)
    starts = {file: [t.offset for t in infos] for file, infos in by_file.items()}
    pieces: dict[ExpertKey, tuple[Piece, ...]] = {}
    for key, location in checkpoint.experts.locations.items():
        slots = itertools.accumulate((segment.nbytes for segment in location.segments), initial=0)
        pieces[key] = tuple(piece for segment, slot in zip(location.segments, slots) for piece in _cut(
            by_file[Path(segment.file)], starts[Path(segment.file)], segment.offset, segment.nbytes, slot))
    return pieces


def _cut(infos: list[TensorInfo], starts: list[int], offset: int, nbytes: int, slot: int) -> list[Piece]:
    """The pieces of the file range [offset, offset + nbytes), one per tensor it crosses."""
    pieces, end = [], offset + nbytes
    while offset < end:
        info = infos[bisect.bisect_right(starts, offset) - 1]
        size = min(end, info.offset + info.nbytes) - offset
        if size <= 0:
            raise CheckpointError(f"byte {offset} of {info.file} lies in no tensor")
        pieces.append(Piece(info.name, info.file.name, offset, slot, size))
        offset, slot = offset + size, slot + size
    return pieces


@dataclass(frozen=True)
class Manifest:
    path: Path  # the checkpoint directory
    pieces: dict[ExpertKey, tuple[Piece, ...]]
    digests: dict[ExpertKey, tuple[int, ...]]  # one per piece
    shards: dict[str, dict]  # shard file name -> {"bytes": size, "sha256": hex or None}

    def begin(self, key: ExpertKey) -> "ExpertCheck":
        """The check of key's bytes, fed in slot order as they are read."""
        return ExpertCheck(self, key)

    def check(self, key: ExpertKey, buffer: torch.Tensor) -> None:
        """Raises IntegrityError unless the expert's slot (1-D uint8 in host memory) matches its digests."""
        check = self.begin(key)
        check.update(buffer)
        if not check.done:
            raise ValueError(f"{buffer.numel()} bytes given for expert {tuple(key)}, which has more")

    def check_batch(self, keys: Sequence[ExpertKey], buffers: Sequence[torch.Tensor]) -> None:
        for key, buffer in zip(keys, buffers):
            self.check(key, buffer)

    def save(self) -> Path:
        experts = {f"{key.layer}/{key.expert}": [[p.tensor, p.shard, p.file_offset, p.slot_offset, p.nbytes,
                                                  f"{d:016x}"] for p, d in zip(self.pieces[key], self.digests[key])]
                   for key in sorted(self.pieces)}
        data = {"format": FORMAT, "version": VERSION, "hash": HASH, "shards": self.shards, "experts": experts}
        return write_json(data, self.path / MANIFEST_FILE)


class ExpertCheck:
    """One expert's bytes checked in slot order as they arrive: each piece once complete; `done` once all matched."""

    def __init__(self, manifest: Manifest, key: ExpertKey):
        self._manifest, self._key = manifest, key
        self._pieces, self._digests = manifest.pieces[key], manifest.digests[key]
        self._next, self._at = 0, 0  # the piece being hashed; the slot offset of the next byte
        self._hasher = xxhash.xxh3_64()

    @property
    def done(self) -> bool:
        return self._next == len(self._pieces)

    def update(self, data: torch.Tensor) -> None:
        """The expert's next bytes (1-D uint8); IntegrityError at the first piece they complete that differs."""
        data = host_bytes(data)
        pos = 0
        while pos < len(data):
            if self.done:
                raise ValueError(f"more bytes given than expert {tuple(self._key)} has")
            piece = self._pieces[self._next]
            end = piece.slot_offset + piece.nbytes
            n = min(len(data) - pos, end - self._at)
            self._hasher.update(data[pos : pos + n])
            pos, self._at = pos + n, self._at + n
            if self._at == end:
                got, want = self._hasher.intdigest(), self._digests[self._next]
                self._hasher.reset()
                self._next += 1
                if got != want:
                    raise IntegrityError(mismatch(self._manifest.path, self._key, piece, got, want))


def host_bytes(data) -> np.ndarray:
    """data's bytes as a numpy view: a tensor in host memory, or an array; a device tensor is refused."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"expert bytes are checked in host memory, where they were read; got a tensor on "
                             f"{data.device} (a device slot is never read back)")
        return data.numpy()
    return data


def mismatch(path: Path, key: ExpertKey, piece: Piece, got: int, want: int, also: str = "") -> str:
    """The one-line message of a damaged piece (`also`: what else is damaged, said before the advice)."""
    return (f"damaged expert bytes: shard {piece.shard}, tensor {piece.tensor}, MoE layer {key.layer} "
            f"expert {key.expert} ({HASH} {got:016x}, manifest {want:016x}){also}; re-download the shard, "
            f"then run `moestream verify --model {path}`")


def load_manifest(checkpoint: CheckpointIndex) -> Manifest | None:
    """The checkpoint's manifest, None if it has none; CheckpointError if it is unreadable or stale."""
    file = checkpoint.path / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
        if data.get("format") != FORMAT or data.get("version") != VERSION or data.get("hash") != HASH:
            raise ValueError("unknown format, version or hash")
        recorded = {_key(name): [tuple(entry) for entry in entries] for name, entries in data["experts"].items()}
        shards = dict(data["shards"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"unreadable manifest {file} ({error}); run `moestream verify` again") from None
    pieces = expert_pieces(checkpoint)
    for shard, info in shards.items():  # the manifest describes these shards and this layout of every expert
        size = (checkpoint.path / shard).stat().st_size if (checkpoint.path / shard).is_file() else None
        if size != info.get("bytes"):
            raise CheckpointError(f"manifest {file} is stale: shard {shard} has {size} bytes, the manifest "
                                  f"says {info.get('bytes')}; run `moestream verify` again")
    for key, found in pieces.items():
        layout = [(p.tensor, p.shard, p.file_offset, p.slot_offset, p.nbytes) for p in found]
        if [tuple(entry[:5]) for entry in recorded.get(key, [])] != layout:
            raise CheckpointError(f"manifest {file} is stale: MoE layer {key.layer} expert {key.expert} "
                                  "is laid out differently; run `moestream verify` again")
    digests = {key: tuple(int(entry[5], 16) for entry in recorded[key]) for key in pieces}
    return Manifest(checkpoint.path, pieces, digests, shards)


def _key(name: str) -> ExpertKey:
    layer, expert = name.split("/")
    return ExpertKey(int(layer), int(expert))

