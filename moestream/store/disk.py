"""Reads expert bytes from the checkpoint's files into slots, so that the page cache does not hide disk cost.

On Linux each file is opened with O_DIRECT: reads are rounded out to the logical block size (4096
bytes); a piece's whole blocks land straight in its destination where the two are congruent modulo
the block, the rest in a staging buffer and copied out (`moestream.store.scatter`). Where O_DIRECT
is unavailable or refused (EINVAL at open or first read), that file is read with buffered `preadv`
and the range read is dropped from the page cache (`POSIX_FADV_DONTNEED`); logged once per reader.

A batch's segments are sorted by file and offset, coalesced into runs (at most `max_gap_bytes`
apart) and cut into requests of at most `staging_bytes`, kept in flight by `num_workers` I/O
threads (`preadv` releases the GIL): one request at a time leaves a fast disk idle. Staged bytes
are copied out with numpy, not torch: a torch copy may split over intra-op threads and wait on a
descheduled one. The reader knows segments and bytes, not experts, tiers or policies.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from moestream.checkpoint.layout import Segment
from moestream.errors import CheckpointError
from moestream.store.scatter import Piece, Request, Run, scatter_plan

logger = logging.getLogger(__name__)

BLOCK_BYTES = 4096  # logical block size that O_DIRECT offsets, lengths and buffers are aligned to
STAGING_BYTES = 1 * 2**20  # the largest single read request (one staging buffer per worker)
NUM_WORKERS = 8  # read requests in flight at once
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # what a filesystem answers when it refuses O_DIRECT


@dataclass
class ReadStats:
    bytes_read: int = 0  # bytes delivered into destinations
    bytes_fetched: int = 0  # bytes transferred from the files (with alignment and gaps)
    num_reads: int = 0  # read syscalls
    read_s: float = 0.0  # wall time of read calls (requests in flight together count once)
    direct_bytes: int = 0  # bytes read straight into destinations, without a staging copy


@dataclass
class _Handle:
    fd: int
    direct: bool


def coalesce_batch(batch: Sequence[Sequence[Segment]], max_gap_bytes: int = 0) -> list[Run]:
    """File runs of batch[i]'s segments (in slot order) for each destination i; <= max_gap_bytes apart share one."""
    pieces = []
    for index, segments in enumerate(batch):
        dst = 0
        for seg in segments:
            file = seg.file if isinstance(seg.file, Path) else Path(seg.file)
            pieces.append((file, Piece(seg.offset, seg.nbytes, dst, index)))
            dst += seg.nbytes
    pieces.sort(key=lambda item: (item[0].parts, item[1].file_offset))
    runs: list[tuple[Path, int, int, list[Piece]]] = []
    for file, piece in pieces:
        end = piece.file_offset + piece.nbytes
        if runs and runs[-1][0] == file and piece.file_offset <= runs[-1][2] + max_gap_bytes:
            runs[-1][3].append(piece)
            runs[-1] = (file, runs[-1][1], max(runs[-1][2], end), runs[-1][3])
        else:
            runs.append((file, piece.file_offset, end, [piece]))
    return [Run(file, start, end, tuple(group)) for file, start, end, group in runs]


def split(run: Run, align: int, max_bytes: int) -> list[Request]:
    """The run's range rounded out to align, cut into requests of at most max_bytes (a multiple of align)."""
    start, end = run.start - run.start % align, -(-run.end // align) * align
    return [Request(run, pos, min(max_bytes, end - pos)) for pos in range(start, end, max_bytes)]


def _skip(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """buffers without their first nbytes."""
    for i, buffer in enumerate(buffers):
        if nbytes < buffer.nbytes:
            return [buffer[nbytes:], *buffers[i + 1 :]]
        nbytes -= buffer.nbytes
    return []


class DiskReader:
    def __init__(self, direct_io: bool = True, block_bytes: int = BLOCK_BYTES, staging_bytes: int = STAGING_BYTES,
                 max_gap_bytes: int | None = None, num_workers: int = NUM_WORKERS):
        if block_bytes < 1 or staging_bytes < block_bytes or staging_bytes % block_bytes:
            raise ValueError("staging_bytes must be a positive multiple of block_bytes")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.block_bytes, self.staging_bytes, self.num_workers = block_bytes, staging_bytes, num_workers
        self.max_gap_bytes = block_bytes if max_gap_bytes is None else max_gap_bytes
        self._staging: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._pool: ThreadPoolExecutor | None = None
        self._handles: dict[Path, _Handle] = {}
        self._retired: list[int] = []  # descriptors replaced by a fallback, closed by close()
        self._lock, self._warned, self.stats = threading.Lock(), False, ReadStats()

    def read(self, segments: Sequence[Segment], dst: torch.Tensor) -> int:  # dst: 1-D uint8 on the CPU
        return self.read_batch([(segments, dst)])

    def read_batch(self, batch: Sequence[tuple[Sequence[Segment], torch.Tensor]]) -> int:
        """Fill each destination with its concatenated segments, requests in flight together; returns bytes read."""
        total = 0
        for segments, dst in batch:
            nbytes = sum(s.nbytes for s in segments)
            if dst.device.type != "cpu" or dst.dtype != torch.uint8 or dst.dim() != 1 or dst.numel() < nbytes:
                raise ValueError(f"need a 1-D uint8 CPU destination of >= {nbytes} bytes, got {tuple(dst.shape)}")
            total += nbytes
        began = time.perf_counter()
        runs = coalesce_batch([segments for segments, _ in batch], self.max_gap_bytes)
        requests = [r for run in runs for r in split(run, self._align(run.file), self.staging_bytes)]
        self._perform(requests, [dst.numpy() for _, dst in batch])  # numpy copies: no intra-op threads
        with self._lock:
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
        with self._lock:
            self.stats = ReadStats()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            for fd in [h.fd for h in self._handles.values()] + self._retired:
                os.close(fd)
            self._handles.clear()
            self._retired.clear()

    def __enter__(self) -> "DiskReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _align(self, file: Path) -> int:
        with self._lock:
            return self.block_bytes if self._handle(file).direct else 1

    def _perform(self, requests: list[Request], dsts: list[np.ndarray]) -> None:
        """Runs the requests, num_workers in flight; raises once all are done (no write lands after an error)."""
        if len(requests) == 1 or self.num_workers == 1:
            for request in requests:
                self._request(request, dsts)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_workers - 1, thread_name_prefix="moestream-io")
        futures = [self._pool.submit(self._request, request, dsts) for request in requests[1:]]
        errors: list[BaseException] = []
        try:
            self._request(requests[0], dsts)
        except BaseException as error:
            errors.append(error)
        errors += [e for e in (future.exception() for future in futures) if e is not None]
        if errors:
            raise errors[0]

    def _request(self, request: Request, dsts: list[np.ndarray]) -> None:
        staging = self._take_staging()
        try:
            plan = scatter_plan(request, dsts, staging, self._align(request.run.file))
            self._read_request(request, plan.buffers)
            plan.copy_out(staging, dsts)
            with self._lock:
                self.stats.direct_bytes += plan.direct_bytes
        finally:
            self._staging.put(staging)

    def _take_staging(self) -> np.ndarray:
        try:
            return self._staging.get_nowait()
        except queue.Empty:
            raw = np.empty(self.staging_bytes + self.block_bytes, dtype=np.uint8)
            start = (-raw.ctypes.data) % self.block_bytes
            return raw[start : start + self.staging_bytes]  # [staging_bytes], block-aligned

    def _read_request(self, request: Request, buffers: list[memoryview]) -> int:
        file = request.run.file
        with self._lock:
            handle = self._handle(file)
        try:
            got = self._preadv(handle.fd, buffers, request.start)
        except OSError as err:
            if not (handle.direct and err.errno in _REFUSED):
                raise
            handle = self._fall_back(file, handle)
            got = self._preadv(handle.fd, buffers, request.start)
        if not handle.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fd, request.start, request.nbytes, os.POSIX_FADV_DONTNEED)
        if got < request.nbytes and request.start + got < request.run.end:
            raise CheckpointError(f"{file} ends at byte {request.start + got}, before byte {request.run.end} of an expert")
        return got

    def _preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        """Read into buffers, in order, from offset; fewer bytes than they hold only at end of file."""
        total, got, calls = sum(b.nbytes for b in buffers), 0, 0
        while got < total:
            n = os.preadv(fd, _skip(buffers, got), offset + got)
            calls += 1
            if n == 0:
                break
            got += n
        with self._lock:
            self.stats.num_reads += calls
            self.stats.bytes_fetched += got
        return got

    def _handle(self, file: Path) -> _Handle:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = self._open(file, self.direct_io)
        return handle

    def _fall_back(self, file: Path, refused: _Handle) -> _Handle:
        """Replaces a direct handle that a read refused with a buffered one (once, whichever worker asks)."""
        with self._lock:
            handle = self._handles[file]
            if handle is refused:
                self._retired.append(refused.fd)  # other workers may still be using it
                self._note_fallback(file)
                handle = self._handles[file] = self._open(file, direct=False)
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
