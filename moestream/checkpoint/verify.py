"""Checks a checkpoint's shards once, e.g. after a download, and records per-expert digests: each shard is read
once, sequentially; its sha256 is computed where a Hugging Face cache snapshot publishes one (the blob's name), and
every expert piece gets its xxh3-64 digest (`manifest.py`), compared with an existing manifest or else written. A
mismatch raises IntegrityError and writes nothing. Knows files and digests, not runtimes or policies."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import xxhash

from moestream.checkpoint.index import build_index
from moestream.checkpoint.manifest import IntegrityError, Manifest, Piece, expert_pieces, load_manifest, mismatch
from moestream.topology import ExpertKey

CHUNK_BYTES = 16 * 2**20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class VerifyReport:
    path: Path
    num_shards: int
    num_published: int  # shards whose sha256 was compared with a published one
    num_experts: int
    bytes_checked: int
    seconds: float
    manifest_written: bool  # False: compared with the manifest already there

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_checked / self.seconds if self.seconds > 0 else 0.0


def published_sha256(shard: Path) -> str | None:
    """The sha256 a Hugging Face cache names a shard's blob by (the link's target), else None."""
    if not shard.is_symlink():
        return None
    target = shard.resolve()
    return target.name if target.parent.name == "blobs" and _SHA256.match(target.name) else None


def verify(path: str | Path, on_bytes: Callable[[int], None] = lambda n: None, rewrite: bool = False,
           on_start: Callable[[int], None] = lambda total: None) -> VerifyReport:
    """Checks every shard in `path` (on_start(total bytes), on_bytes(n) per chunk); rewrite: record digests afresh."""
    began = time.perf_counter()
    checkpoint = build_index(Path(path))  # damaged headers and truncated shards fail here
    previous = None if rewrite else load_manifest(checkpoint)
    pieces = expert_pieces(checkpoint)
    by_shard: dict[str, list[tuple[ExpertKey, int, Piece]]] = {}  # each shard's (expert, piece number, piece)
    for key, found in pieces.items():
        for number, piece in enumerate(found):
            by_shard.setdefault(piece.shard, []).append((key, number, piece))
    shards = sorted({info.file for info in checkpoint.tensors.values()})
    on_start(sum(shard.stat().st_size for shard in shards))
    digests: dict[tuple[ExpertKey, int], int] = {}
    records = {}
    for shard in shards:
        published = published_sha256(shard)
        sha256, found = _scan(shard, by_shard.get(shard.name, []), published is not None, on_bytes)
        if published is not None and sha256 != published:
            raise IntegrityError(f"damaged shard {shard}: sha256 {sha256}, published {published}")
        digests.update(found)
        records[shard.name] = {"bytes": shard.stat().st_size, "sha256": published}
    manifest = Manifest(checkpoint.path, pieces,
                        {key: tuple(digests[key, n] for n in range(len(found))) for key, found in pieces.items()},
                        records)
    if previous is None:
        manifest.save()
    damaged = [] if previous is None else [(key, piece, got, want) for key, found in pieces.items() for piece, got, want
                                           in zip(found, manifest.digests[key], previous.digests[key]) if got != want]
    if damaged:  # the first damaged expert, and how many are damaged in all
        others = len({key for key, *_ in damaged}) - 1
        more = f" (and {others} more damaged expert{'s' if others != 1 else ''})" if others else ""
        raise IntegrityError(mismatch(checkpoint.path, *damaged[0], also=more))
    published = sum(record["sha256"] is not None for record in records.values())
    return VerifyReport(checkpoint.path, len(shards), published, len(pieces),
                        sum(s.stat().st_size for s in shards), time.perf_counter() - began, previous is None)


def _scan(shard: Path, pieces: list[tuple[ExpertKey, int, Piece]], with_sha256: bool,
          on_bytes: Callable[[int], None]) -> tuple[str | None, dict[tuple[ExpertKey, int], int]]:
    """(sha256 of the file if asked, xxh3 of each piece), reading the file once in order."""
    pieces = sorted(pieces, key=lambda item: item[2].file_offset)
    hashers = [xxhash.xxh3_64() for _ in pieces]
    sha = hashlib.sha256() if with_sha256 else None
    first, position = 0, 0
    with shard.open("rb", buffering=0) as handle:
        while chunk := handle.read(CHUNK_BYTES):
            view, end = memoryview(chunk), position + len(chunk)
            if sha is not None:
                sha.update(view)
            while first < len(pieces) and _end(pieces[first][2]) <= position:
                first += 1
            for (_, _, piece), hasher in zip(pieces[first:], hashers[first:]):
                if piece.file_offset >= end:
                    break
                lo, hi = max(piece.file_offset, position), min(_end(piece), end)
                hasher.update(view[lo - position : hi - position])
            position = end
            on_bytes(len(chunk))
    return (sha.hexdigest() if sha else None,
            {(key, number): hasher.intdigest() for (key, number, _), hasher in zip(pieces, hashers)})


def _end(piece: Piece) -> int:
    return piece.file_offset + piece.nbytes

