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


def sequential_read_bandwidth(path: str | Path, nbytes: int | None = None,
                              block_bytes: int = DEFAULT_BLOCK_BYTES, direct_io: bool = True) -> float:
    """Bytes per second reading the first nbytes of path (all of it by default) in block_bytes reads."""
    path = Path(path)
    nbytes = min(nbytes or os.path.getsize(path), os.path.getsize(path))
    if nbytes < 1 or block_bytes < 1:
        raise ValueError(f"nothing to read: {path} gives {nbytes} bytes in blocks of {block_bytes}")
    dst = torch.empty(block_bytes, dtype=torch.uint8)  # [block_bytes]
    staging_bytes = -(-block_bytes // BLOCK_BYTES) * BLOCK_BYTES
    with DiskReader(direct_io=direct_io, staging_bytes=staging_bytes) as reader:
        reader.drop_cache(path)
        began = time.perf_counter()
        for offset in range(0, nbytes, block_bytes):
            reader.read([Segment(path, offset, min(block_bytes, nbytes - offset))], dst)
        return nbytes / (time.perf_counter() - began)


def expert_stream_bandwidth(locations: Sequence[ExpertLocation], direct_io: bool = True) -> float:
    """Bytes per second reading the experts at locations one after the other into one slot."""
    if not locations:
        raise ValueError("no expert locations to read")
    dst = torch.empty(max(loc.nbytes for loc in locations), dtype=torch.uint8)  # [expert_bytes]
    with DiskReader(direct_io=direct_io) as reader:
        for file in {seg.file for loc in locations for seg in loc.segments}:
            reader.drop_cache(file)
        began = time.perf_counter()
        for location in locations:
            reader.read(location.segments, dst)
        return sum(loc.nbytes for loc in locations) / (time.perf_counter() - began)
