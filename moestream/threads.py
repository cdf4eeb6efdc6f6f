"""How many threads compute uses: the cores this process may run on, and torch's intra-op thread count
for a block of code. Imports torch only when a block runs, so that torch-free modules (the CLI's
parsers, the bench commands) may import it. Knows nothing of what the threads compute."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

from moestream.cgroup import CGROUP_ROOT, PROC_CGROUP


def available_cores() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def compute_threads(requested: int, engine_threads: int, current: int) -> int:
    """The threads compute should use: `requested` where > 0, else the available cores less `engine_threads` (I/O,
    a predictor), at least one and at most torch's `current` count (a count lowered by the user or a test is kept)."""
    return requested if requested > 0 else max(1, min(current, available_cores() - engine_threads))


class ComputeThreads:
    """While an engine is open (process-wide, put back by `restore`): torch on `num_threads` threads, numpy's BLAS
    on one, since the policy's numpy work runs between torch's kernels and a second spinning pool takes the cores
    they need (a prefill with a predicting policy ran twice as slow with torch on 2 threads)."""

    def __init__(self, requested: int, engine_threads: int):
        import torch
        from threadpoolctl import threadpool_limits

        self.engine_threads, self._before = engine_threads, torch.get_num_threads()
        self.num_threads = compute_threads(requested, engine_threads, self._before)
        self._blas = threadpool_limits(limits=1, user_api="blas")
        torch.set_num_threads(self.num_threads)

    def restore(self) -> None:
        import torch

        torch.set_num_threads(self._before)
        self._blas.restore_original_limits()

    def __str__(self) -> str:
        """The start-up line's words: compute's threads, the cores and what the engine keeps for itself."""
        kept = f", {self.engine_threads} left to the engine's I/O and predictor threads" if self.engine_threads else ""
        return (f"compute uses {self.num_threads} thread{'s' if self.num_threads != 1 else ''} "
                f"({available_cores()} cores{kept}; --threads to change)")


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op thread count inside the block, restored after (small models run fastest on one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cgroup_cpu_quota() -> float | None:
    """The CPUs a cgroup v2 `cpu.max` allows this process (quota / period), or None where unlimited."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        quota, period = (CGROUP_ROOT / path.lstrip("/") / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, StopIteration, ValueError):
        return None
