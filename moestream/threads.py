"""torch's intra-op thread count for a block of code. Imports torch only when a block runs, so that
torch-free modules (the CLI's parsers, the bench commands) may import it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op thread count inside the block, restored after. Small models run fastest, and do
    not stall on a shared machine, with one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
