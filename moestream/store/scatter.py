"""Plans one read request as a vector of buffers: pieces' aligned interiors land in their destinations, the rest in staging.

A request is a block-aligned byte range of one file holding pieces of destinations. A piece congruent
with its destination modulo the block has its whole blocks read straight into it; partial blocks, gaps
and other pieces go through staging and are copied out. Nothing is written to a destination outside its
pieces' bytes. The planner knows bytes and addresses, not files, experts or tiers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IOV_MAX = 1024  # the most buffers one preadv takes (Linux's UIO_MAXIOV)


@dataclass(frozen=True)
class Piece:
    file_offset: int
    nbytes: int
    dst_offset: int  # where these bytes go in their destination
    dst: int = 0  # which destination of the batch


@dataclass(frozen=True)
class Run:
    """A byte range of one file holding pieces of one or more destinations."""

    file: Path
    start: int
    end: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Request:
    """One read syscall's range [start, start + nbytes) of a run's file (aligned out for O_DIRECT)."""

    run: Run
    start: int
    nbytes: int


@dataclass(frozen=True)
class Copy:
    dst: int  # which destination
    dst_at: int
    staging_at: int
    nbytes: int


@dataclass
class ScatterPlan:
    buffers: list[memoryview] = field(default_factory=list)  # in file order, covering the request
    copies: list[Copy] = field(default_factory=list)  # staging -> destinations, after the read
    direct_bytes: int = 0  # bytes read straight into destinations

    def copy_out(self, staging: np.ndarray, dsts: list[np.ndarray]) -> None:
        for c in self.copies:
            dsts[c.dst][c.dst_at : c.dst_at + c.nbytes] = staging[c.staging_at : c.staging_at + c.nbytes]


def scatter_plan(request: Request, dsts: list[np.ndarray], staging: np.ndarray, align: int) -> ScatterPlan:
    """The buffers and copies of a request; staging holds at least request.nbytes."""
    plan = _plan(request, dsts, staging, align, in_place=True)
    if plan is None or len(plan.buffers) > IOV_MAX:
        plan = _plan(request, dsts, staging, align, in_place=False)
    return plan


def _plan(request: Request, dsts: list[np.ndarray], staging: np.ndarray, align: int,
          in_place: bool) -> ScatterPlan | None:
    """None where pieces overlap in the file (their shared bytes must be staged)."""
    start, end = request.start, request.start + request.nbytes
    plan, staged, wanted = ScatterPlan(), _Staged(staging), []
    covered = start  # the end of the bytes planned so far (into staging or destinations)
    last_hi = start  # the end of the pieces seen so far
    for piece in request.run.pieces:
        lo, hi = max(piece.file_offset, start), min(piece.file_offset + piece.nbytes, end)
        if lo >= hi:
            continue
        if lo < last_hi and in_place:
            return None
        last_hi = max(last_hi, hi)
        shift = piece.dst_offset - piece.file_offset  # destination index of file byte x: x + shift
        a, b = -(-lo // align) * align, hi // align * align  # the piece's whole blocks
        if in_place and a < b and (dsts[piece.dst].ctypes.data + a + shift) % align == 0:
            plan.buffers += staged.up_to(covered, a)
            plan.buffers.append(memoryview(dsts[piece.dst][a + shift : b + shift]))
            plan.direct_bytes += b - a
            covered = b
            wanted += [(piece.dst, lo, a, shift), (piece.dst, b, hi, shift)]
        else:
            wanted.append((piece.dst, lo, hi, shift))
    plan.buffers += staged.up_to(covered, end)
    plan.copies = [staged.copy(*w) for w in wanted if w[1] < w[2]]
    return plan


class _Staged:
    """File ranges placed one after another in the staging buffer."""

    def __init__(self, staging: np.ndarray):
        self.staging, self.used = staging, 0
        self.starts: list[int] = []  # file offset of each range
        self.at: list[int] = []  # its offset in staging

    def up_to(self, lo: int, hi: int) -> list[memoryview]:
        if lo >= hi:
            return []
        self.starts.append(lo)
        self.at.append(self.used)
        self.used += hi - lo
        return [memoryview(self.staging[self.used - (hi - lo) : self.used])]

    def copy(self, dst: int, lo: int, hi: int, shift: int) -> Copy:
        i = bisect.bisect_right(self.starts, lo) - 1
        return Copy(dst, lo + shift, self.at[i] + lo - self.starts[i], hi - lo)
