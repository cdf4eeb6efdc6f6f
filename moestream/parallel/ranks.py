"""The ranks of one run: this process's place among those that `torchrun` started, and the three process
groups every collective of expert parallelism goes through (see `join_ranks`). A failed collective becomes
one `RankFailure` naming this rank and what it waited for. Knows no engine, placement or model."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

from moestream.errors import MoestreamError

UNBOUNDED = timedelta(days=7)  # joining, and the control group's timeout: start-up, a bench's runs


class RankFailure(MoestreamError):
    """Another rank died or hung: this one cannot go on."""


def launched() -> bool:
    """Whether this process was started by torchrun (or torch.distributed.run)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    device: str  # this rank's compute device
    timeout_s: float  # a step's collectives fail after this long
    steps: Any  # each layer's combine (NCCL or gloo), the transfer timeout
    control: Any  # gloo, no timeout to speak of: the start of a run, opening the engines, a bench's runs
    announce: Any  # gloo, the transfer timeout: rank 0's step announcements and heartbeats, statistics

    @property
    def leads(self) -> bool:
        """Whether this rank schedules (and alone prints and writes)."""
        return self.rank == 0

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turns a failed collective into one RankFailure that says what this rank waited for."""
        try:
            yield
        except RuntimeError as error:
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RankFailure(f"expert parallelism: rank {self.rank} of {self.world_size} lost the other ranks "
                              f"during {what} (a rank died, or hung past --transfer-timeout-s "
                              f"{self.timeout_s:g} s): {cause}") from None


def free_port() -> int:
    """A TCP port free on this host now (for a process group's store)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def rank_device(device: str) -> str:
    """A CUDA device per local rank (cuda: LOCAL_RANK modulo the devices), else the device as given."""
    import torch

    if not device.startswith("cuda"):
        return device
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % max(torch.cuda.device_count(), 1)}"


def step_backend(device: str) -> str:
    """NCCL where each rank of this node has a GPU of its own; gloo on CPUs, and where ranks share a GPU (NCCL refuses
    two ranks of one communicator on one device; gloo's all-reduce of CUDA tensors goes through host memory)."""
    import torch

    cuda = device.startswith("cuda")
    return "nccl" if cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count() else "gloo"


def join_ranks(device: str, timeout_s: float) -> RankContext:
    """Joins the ranks however far apart they start (on a loaded machine, many seconds), then opens a group for
    each layer's combine (NCCL where each rank has a GPU of its own, else gloo) and a gloo group for rank 0's
    announcements, both with the transfer timeout, and a gloo group for what may wait as long as it takes."""
    import torch
    import torch.distributed as dist

    device = rank_device(device)
    backend = step_backend(device)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        # The default group's timeout is the rendezvous's: the transfer timeout there failed a start-up on a
        # loaded machine ("waiting for clients. 2/3 clients joined", issue 43). It carries no collective.
        dist.init_process_group(backend, timeout=UNBOUNDED)
        control = dist.new_group(backend="gloo", timeout=UNBOUNDED)
        steps = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        announce = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:
        raise RankFailure(f"expert parallelism: cannot join the ranks: {error}") from None
    return RankContext(dist.get_rank(), dist.get_world_size(), device, timeout_s, steps, control, announce)


def leave_ranks() -> None:
    """Closes the process groups (after a failure too)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
