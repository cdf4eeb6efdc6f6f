"""Reads expert bytes from the checkpoint's files into slots, so that the page cache does not hide disk cost.

On Linux each file is opened with O_DIRECT: reads are rounded out to the logical block size
(4096 bytes) and land in a block-aligned staging buffer, from which the wanted bytes are copied
into the destination slot. Fallback: where O_DIRECT is unavailable (non-Linux systems) or the
filesystem refuses it (EINVAL at open or at the first read), that file is read with buffered
`preadv` and the range just read is dropped from the page cache with
`posix_fadvise(POSIX_FADV_DONTNEED)` where the system has it. The choice is made per file and
logged once per reader; `direct_io=False` forces the fallback everywhere.

An expert's segments are sorted by file and offset and coalesced into runs (segments at most
`max_gap_bytes` apart are read by one syscall), whatever their order in the slot. File descriptors
stay open until close(). The reader knows segments and bytes, not experts, tiers or policies.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from moestream.checkpoint.layout import Segment
from moestream.errors import CheckpointError

logger = logging.getLogger(__name__)

BLOCK_BYTES = 4096  # logical block size that O_DIRECT offsets, lengths and buffers are aligned to
STAGING_BYTES = 16 * 2**20
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # what a filesystem answers when it refuses O_DIRECT


@dataclass(frozen=True)
class Piece:
    file_offset: int
    nbytes: int
    dst_offset: int  # where these bytes go in the destination slot


@dataclass(frozen=True)
class Run:
    """A byte range of one file, read by one syscall per staging-buffer chunk."""

    file: Path
    start: int
    end: int
    pieces: tuple[Piece, ...]


@dataclass
class ReadStats:
    bytes_read: int = 0  # bytes delivered into destinations
    bytes_fetched: int = 0  # bytes transferred from the files (with alignment and gaps)
    num_reads: int = 0  # read syscalls
    read_s: float = 0.0


@dataclass
class _Handle:
    fd: int
    direct: bool


def coalesce(segments: Sequence[Segment], max_gap_bytes: int = 0) -> list[Run]:
    """Group segments (in slot order) into file runs; segments <= max_gap_bytes apart share a run."""
    pieces, dst = [], 0
    for seg in segments:
        pieces.append((Path(seg.file), Piece(seg.offset, seg.nbytes, dst)))
        dst += seg.nbytes
    pieces.sort(key=lambda item: (str(item[0]), item[1].file_offset))
    runs: list[Run] = []
    for file, piece in pieces:
        last = runs[-1] if runs else None
        if last is not None and last.file == file and piece.file_offset <= last.end + max_gap_bytes:
            end = max(last.end, piece.file_offset + piece.nbytes)
            runs[-1] = Run(file, last.start, end, last.pieces + (piece,))
        else:
            runs.append(Run(file, piece.file_offset, piece.file_offset + piece.nbytes, (piece,)))
    return runs


def _aligned_buffer(nbytes: int, align: int) -> np.ndarray:
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


class DiskReader:
    def __init__(self, direct_io: bool = True, block_bytes: int = BLOCK_BYTES,
                 staging_bytes: int = STAGING_BYTES, max_gap_bytes: int | None = None):
        if block_bytes < 1 or staging_bytes < block_bytes or staging_bytes % block_bytes:
            raise ValueError("staging_bytes must be a positive multiple of block_bytes")
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.block_bytes = block_bytes
        self.max_gap_bytes = block_bytes if max_gap_bytes is None else max_gap_bytes
        self._staging = _aligned_buffer(staging_bytes, block_bytes)  # [staging_bytes]
        self._staging_t = torch.from_numpy(self._staging)
        self._handles: dict[Path, _Handle] = {}
        self._lock = threading.Lock()
        self._warned = False
        self.stats = ReadStats()

    def read(self, segments: Sequence[Segment], dst: torch.Tensor) -> int:
        """Fill dst (1-D uint8 on the CPU) with the concatenated segments; returns the bytes read."""
        total = sum(s.nbytes for s in segments)
        if dst.device.type != "cpu" or dst.dtype != torch.uint8 or dst.dim() != 1 or dst.numel() < total:
            raise ValueError(f"need a 1-D uint8 CPU destination of >= {total} bytes, got {tuple(dst.shape)}")
        with self._lock:
            began = time.perf_counter()
            for run in coalesce(segments, self.max_gap_bytes):
                self._read_run(run, dst)
            self.stats.read_s += time.perf_counter() - began
            self.stats.bytes_read += total
        return total

    def is_direct(self, file: Path | str) -> bool:
        """Whether reads of this file bypass the page cache with O_DIRECT (opens it if needed)."""
        with self._lock:
            return self._handle(Path(file)).direct

    def drop_cache(self, file: Path | str) -> None:
        """Ask the kernel to drop the file's cached pages (for cold measurements of buffered reads)."""
        if hasattr(os, "posix_fadvise"):
            with self._lock:
                os.posix_fadvise(self._handle(Path(file)).fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def reset_stats(self) -> None:
        self.stats = ReadStats()

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                os.close(handle.fd)
            self._handles.clear()

    def __enter__(self) -> "DiskReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self, file: Path) -> _Handle:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._open(file, self.direct_io)
            self._handles[file] = handle
        return handle

    def _open(self, file: Path, direct: bool) -> _Handle:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            if direct:
                try:
                    return _Handle(os.open(file, flags | os.O_DIRECT), True)
                except OSError as err:
                    if err.errno not in _REFUSED:
                        raise
                    self._note_fallback(file)
            return _Handle(os.open(file, flags), False)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {file} is missing") from None

    def _note_fallback(self, file: Path) -> None:
        message = "O_DIRECT refused for %s; buffered reads + POSIX_FADV_DONTNEED instead"
        logger.log(logging.DEBUG if self._warned else logging.WARNING, message, file)
        self._warned = True

    def _read_run(self, run: Run, dst: torch.Tensor) -> None:
        handle = self._handle(run.file)
        try:
            self._read_chunks(run, handle, dst)
        except OSError as err:
            if not (handle.direct and err.errno in _REFUSED):
                raise
            os.close(handle.fd)
            self._note_fallback(run.file)
            self._handles[run.file] = handle = self._open(run.file, direct=False)
            self._read_chunks(run, handle, dst)
        if not handle.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fd, run.start, run.end - run.start, os.POSIX_FADV_DONTNEED)

    def _read_chunks(self, run: Run, handle: _Handle, dst: torch.Tensor) -> None:
        align = self.block_bytes if handle.direct else 1
        pos, end = run.start - run.start % align, -(-run.end // align) * align
        while pos < run.end:
            length = min(end - pos, len(self._staging))
            got = self._pread(handle.fd, length, pos)
            self._scatter(run.pieces, pos, pos + got, dst)
            if got < length and pos + got < run.end:
                raise CheckpointError(f"{run.file} ends at byte {pos + got}, before byte {run.end} of an expert")
            pos += length

    def _pread(self, fd: int, length: int, offset: int) -> int:
        """Read up to length bytes at offset into the staging buffer; fewer only at end of file."""
        view, got = memoryview(self._staging), 0
        while got < length:
            n = os.preadv(fd, [view[got:length]], offset + got)
            self.stats.num_reads += 1
            if n == 0:
                break
            got += n
        self.stats.bytes_fetched += got
        return got

    def _scatter(self, pieces: tuple[Piece, ...], chunk_start: int, chunk_end: int, dst: torch.Tensor) -> None:
        """Copy the parts of pieces that lie in [chunk_start, chunk_end) of the file from staging to dst."""
        for piece in pieces:
            lo = max(piece.file_offset, chunk_start)
            hi = min(piece.file_offset + piece.nbytes, chunk_end)
            if lo < hi:
                at = piece.dst_offset + lo - piece.file_offset
                dst[at : at + hi - lo].copy_(self._staging_t[lo - chunk_start : hi - chunk_start])
