"""The engine's copy functions for the links of `moestream.store.transfer`: how a round's bytes move.

Stream order: a copy waits on its link's stream for the last reader of its destination
(`Transfer.after`), and its event (`Transfer.event`) is what a reader of the slot waits for; the host
waits for a copy only before it overwrites the copy's source (a staging slot, or a host slot whose
transfer waits for `after` before its read). Knows no queue, no tier and no policy.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from moestream.checkpoint.layout import Segment
from moestream.store.pool import SlotPool
from moestream.store.streams import Link
from moestream.store.transfer import Errors, Held, Transfer

log = logging.getLogger(__name__)

Read = Callable[[Sequence[tuple[Sequence[Segment], torch.Tensor]]], int]  # a disk reader's read_batch


def read_round(read: Read, staging: SlotPool, link: Link, held: Held) -> Errors:
    """The disk link's copy function: the round's chunks read together straight into their host slots, or
    through staging slots (CUDA without a host tier) and copied up the link. Each chunk is checked in host
    memory before it goes further; a failed check fails its transfer, a failed read every one."""
    chunks = [(transfer, *transfer.piece(count)) for transfer, count in held]
    errors: Errors = {}
    size = staging.num_slots or len(chunks)
    try:
        for start in range(0, len(chunks), size):
            group = chunks[start : start + size]
            landed = _read_group(read, group, staging)
            for j, ((transfer, _, part), host) in enumerate(zip(group, landed)):
                if _checked(transfer, host, errors) and staging.num_slots:
                    transfer.event = link.copy(transfer.dst[part], host, transfer.after)
                    staging.mark_read(j, transfer.event)
    except Exception as error:  # handed to the thread that waits on these experts
        log.debug("a disk read of %d experts failed: %s", len(held), error)
        return {transfer: error for transfer, _ in held}
    return errors


def _read_group(read: Read, group, staging: SlotPool) -> list[torch.Tensor]:
    """Reads a group of chunks into host memory: their slots, or staging slots; returns where each landed."""
    if not staging.num_slots:
        for transfer, _, _ in group:
            if transfer.after is not None:
                transfer.after.synchronize()  # the copy up from this host slot (or compute) is done with it
        landed = [transfer.dst[part] for transfer, _, part in group]
    else:
        landed = []
        for j, (_, segments, part) in enumerate(group):
            staging.wait_reads(j)  # the copy from this staging slot has run
            landed.append(staging.slot(j, segments[0].offset)[: part.stop - part.start])  # congruent: in place
    read([(segments, host) for (_, segments, _), host in zip(group, landed)])
    return landed


def _checked(transfer: Transfer, host: torch.Tensor, errors: Errors) -> bool:
    """Feeds a chunk's bytes, in host memory, to its transfer's check; False (the error kept) if damaged."""
    if transfer.check is None:
        return True
    try:
        transfer.check.update(host)
    except Exception as error:  # a damaged expert: its transfer fails, nothing of it goes further
        errors[transfer] = error
        return False
    return True


def copy_round(link: Link, held: Held) -> Errors:
    """The host -> device link's copy function: issues the round's copies, not waiting for them."""
    errors = {}
    for copy, count in held:
        _, part = copy.piece(count)
        try:
            copy.event = link.copy(copy.dst[part], copy.src[part], copy.after)
        except Exception as error:  # handed to the thread that waits on this expert
            log.debug("a host -> device copy of expert %s failed: %s", tuple(copy.key), error)
            errors[copy] = error
    return errors
