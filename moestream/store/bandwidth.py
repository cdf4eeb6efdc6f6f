"""Cold read bandwidth of the disk tier, measured with the store's own DiskReader.

Used by `moestream bench engine` to report what the disk delivers and to calibrate the simulator's
cost model. Files are dropped from the page cache first and read with O_DIRECT where the filesystem
allows it, so the figures are disk figures, not memory copies. Knows no experts beyond locations.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from moestream.checkpoint.layout import ExpertLocation, Segment
from moestream.store.disk import BLOCK_BYTES, DiskReader

DEFAULT_BLOCK_BYTES = 16 * 2**20


def sequential_read_bandwidth(path: str | Path, nbytes: int | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
                              direct_io: bool = True, request_bytes: int | None = None,
                              num_workers: int = 1) -> float:
    """Bytes per second reading the first nbytes of path (all of it by default) in block_bytes reads.

    Each block is one read request by default; with request_bytes, a block is cut into requests of
    that size, num_workers of them in flight together."""
    path = Path(path)
    nbytes = min(nbytes or os.path.getsize(path), os.path.getsize(path))
    if nbytes < 1 or block_bytes < 1:
        raise ValueError(f"nothing to read: {path} gives {nbytes} bytes in blocks of {block_bytes}")
    dst = torch.empty(block_bytes, dtype=torch.uint8)  # [block_bytes]
    request = -(-(request_bytes or block_bytes) // BLOCK_BYTES) * BLOCK_BYTES
    with DiskReader(direct_io=direct_io, staging_bytes=request, num_workers=num_workers) as reader:
        reader.drop_cache(path)
        began = time.perf_counter()
        for offset in range(0, nbytes, block_bytes):
            reader.read([Segment(path, offset, min(block_bytes, nbytes - offset))], dst)
        return nbytes / (time.perf_counter() - began)


def expert_stream_bandwidth(locations: Sequence[ExpertLocation], direct_io: bool = True, batch: int = 1) -> float:
    """Bytes per second reading the experts at locations, `batch` experts per read call (in flight together)."""
    if not locations or batch < 1:
        raise ValueError("need expert locations to read and a batch of at least 1")
    dsts = [torch.empty(max(loc.nbytes for loc in locations), dtype=torch.uint8) for _ in range(batch)]
    with DiskReader(direct_io=direct_io) as reader:
        for file in {seg.file for loc in locations for seg in loc.segments}:
            reader.drop_cache(file)
        began = time.perf_counter()
        for i in range(0, len(locations), batch):
            reader.read_batch([(loc.segments, dst) for loc, dst in zip(locations[i : i + batch], dsts)])
        return sum(loc.nbytes for loc in locations) / (time.perf_counter() - began)
